//! The `[cluster]` section (DESIGN.md §10): this member's id, its peer listener, the shared secret,
//! the election timeout and the `[[cluster.members]]`, read and checked. No section means a single
//! node. What is built from it (the Raft network, the peer listener) is `cluster`'s and `peer`'s;
//! this module only hands over a configuration that is known to be whole:
//!
//! - `node_id` is the id of one of the members, and member ids are unique and non-zero;
//! - every member's `api` is an `http://` or `https://` URL with a host and no path, and every `peer`
//!   (and `listen`) a `host:port` with a port other than 0; neither repeats among the members;
//! - the secret has at least [`MIN_SECRET_BYTES`] bytes; `election_timeout` is within 100ms..=60s.
//!
//! Every refusal names its key (`cluster.members[2].api`, counting from 0) and says what to write
//! instead. `fsync` must be `"always"` beside a cluster; `Config::validate` checks that, as it spans
//! two sections.

use crate::peer::MIN_SECRET_BYTES;
use crate::setting::{invalid, ConfigError, Millis};
use serde::Deserialize;
use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Duration;

/// The `[cluster]` section. Every key has a default here so that `DELAYD_CLUSTER_*` variables can
/// make the section on their own; [`ClusterConfig::validate`] then demands what has none (a zero
/// `node_id`, an empty `listen` or `secret`, no members: not given).
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// This member's id: one of the `members`' ids.
    pub node_id: u64,
    /// This member's peer listener, `host:port`, where the others' Raft RPCs and snapshots arrive.
    pub listen: String,
    /// Authenticates peer traffic (peer.rs); the same on every member.
    pub secret: String,
    /// How long a follower waits without hearing from a leader before it stands for election;
    /// heartbeats go at a quarter of it.
    pub election_timeout: Millis,
    /// Entries applied between two snapshots of this member's files; each lets its Raft log be
    /// purged up to 1,000 entries (or `snapshot_entries`, if fewer) behind it.
    pub snapshot_entries: u64,
    /// The size of this member's Raft log (WAL) files: the log is purged a whole file at a time.
    pub log_file_bytes: u64,
    /// A member being added to a running cluster (`POST /v1/cluster/members`): it never founds a
    /// cluster of its own from `members`, it waits to be added.
    pub join: bool,
    /// Every member, this one included, the same on every member.
    pub members: Vec<MemberConfig>,
}

/// The fewest and the most entries between two snapshots.
const SNAPSHOT_ENTRIES_RANGE: [u64; 2] = [100, 100_000_000];
/// The smallest and the largest Raft log file.
const LOG_FILE_BYTES_RANGE: [u64; 2] = [64 << 10, 1 << 30];

/// One `[[cluster.members]]` table. Its keys default (to 0 and empty) only so that a missing one is
/// refused by [`ClusterConfig::validate`] naming it, like any other mistake in the section.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemberConfig {
    /// The member's id, non-zero, its own among the members.
    pub id: u64,
    /// The member's client listener, where followers forward `/v1` requests: `http://host:port`.
    pub api: String,
    /// The member's peer listener as the others reach it, `host:port` (a name is resolved when
    /// called, so a Kubernetes DNS name such as `delayd-1.delayd:7171` does).
    pub peer: String,
}

/// The shortest and the longest `election_timeout`.
const ELECTION_TIMEOUT_RANGE: [Duration; 2] = [Duration::from_millis(100), Duration::from_secs(60)];

impl Default for ClusterConfig {
    fn default() -> ClusterConfig {
        ClusterConfig {
            node_id: 0,
            listen: String::new(),
            secret: String::new(),
            election_timeout: Millis(Duration::from_secs(1)),
            snapshot_entries: 5_000,
            log_file_bytes: 64 << 20,
            join: false,
            members: Vec::new(),
        }
    }
}

/// The secret's length only: a configuration may be logged.
impl std::fmt::Debug for ClusterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterConfig")
            .field("node_id", &self.node_id)
            .field("listen", &self.listen)
            .field("secret", &format_args!("({} bytes)", self.secret.len()))
            .field("election_timeout", &self.election_timeout)
            .field("snapshot_entries", &self.snapshot_entries)
            .field("log_file_bytes", &self.log_file_bytes)
            .field("join", &self.join)
            .field("members", &self.members)
            .finish()
    }
}

impl ClusterConfig {
    /// The member whose id is `id`.
    pub fn member(&self, id: u64) -> Option<&MemberConfig> {
        self.members.iter().find(|member| member.id == id)
    }

    /// This member (`node_id`'s entry among the members).
    ///
    /// # Panics
    /// On a configuration that was not validated and lacks it; [`crate::config::Config::load`]
    /// validates.
    pub fn this_member(&self) -> &MemberConfig {
        self.member(self.node_id)
            .expect("a validated [cluster] has node_id among its members")
    }

    /// Refuses what a member could not run with, naming the key (`cluster.KEY`,
    /// `cluster.members[i].KEY`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.node_id == 0 {
            return Err(invalid(
                "cluster.node_id",
                "required: this member's id, one of the ids in [[cluster.members]] (a whole number \
                 above 0; DELAYD_CLUSTER_NODE_ID sets it per member)",
            ));
        }
        if self.listen.is_empty() {
            return Err(invalid(
                "cluster.listen",
                "required: this member's peer listener as host:port, such as \"0.0.0.0:7171\", \
                 where the other members' Raft RPCs arrive",
            ));
        }
        host_port(&self.listen).map_err(|why| invalid("cluster.listen", why))?;
        if self.secret.is_empty() {
            return Err(invalid(
                "cluster.secret",
                format!(
                    "required, the same on every member: a random string of at least \
                     {MIN_SECRET_BYTES} bytes, such as the output of `openssl rand -hex 32` (set \
                     DELAYD_CLUSTER_SECRET rather than write it in the file)"
                ),
            ));
        }
        if self.secret.len() < MIN_SECRET_BYTES {
            return Err(invalid(
                "cluster.secret",
                format!(
                    "{} bytes is too short: use a random string of at least {MIN_SECRET_BYTES} \
                     bytes, the same on every member, such as the output of `openssl rand -hex 32`",
                    self.secret.len()
                ),
            ));
        }
        let [shortest, longest] = ELECTION_TIMEOUT_RANGE;
        if self.election_timeout.0 < shortest || self.election_timeout.0 > longest {
            return Err(invalid(
                "cluster.election_timeout",
                "must be between 100ms and 60s (heartbeats go at a quarter of it; \"1s\" suits a \
                 local network)",
            ));
        }
        let [fewest, most] = SNAPSHOT_ENTRIES_RANGE;
        if !(fewest..=most).contains(&self.snapshot_entries) {
            return Err(invalid(
                "cluster.snapshot_entries",
                format!("must be between {fewest} and {most} (5000 is the default)"),
            ));
        }
        let [smallest, largest] = LOG_FILE_BYTES_RANGE;
        if !(smallest..=largest).contains(&self.log_file_bytes)
            || !self.log_file_bytes.is_multiple_of(4096)
        {
            return Err(invalid(
                "cluster.log_file_bytes",
                format!(
                    "must be a multiple of 4096 between {smallest} and {largest} (67108864, 64 MiB, \
                     is the default)"
                ),
            ));
        }
        self.validate_members()?;
        if self.member(self.node_id).is_none() {
            let ids: Vec<String> = self.members.iter().map(|m| m.id.to_string()).collect();
            return Err(invalid(
                "cluster.node_id",
                format!(
                    "{} is not among the members' ids ({}): set it to this member's own id",
                    self.node_id,
                    ids.join(", ")
                ),
            ));
        }
        Ok(())
    }

    fn validate_members(&self) -> Result<(), ConfigError> {
        if self.members.is_empty() {
            return Err(invalid(
                "cluster.members",
                "at least one member is required: a [[cluster.members]] table with id, api and \
                 peer for every member, this one included, the same on every member",
            ));
        }
        // Where each id, api and peer was first seen, for the error that names a repeat.
        let mut ids = HashMap::new();
        let mut apis = HashMap::new();
        let mut peers = HashMap::new();
        for (at, member) in self.members.iter().enumerate() {
            let key = |name: &str| format!("cluster.members[{at}].{name}");
            if member.id == 0 {
                return Err(invalid(
                    &key("id"),
                    "required: a whole number above 0, each member's its own",
                ));
            }
            if let Some(first) = ids.insert(member.id, at) {
                return Err(invalid(
                    &key("id"),
                    format!(
                        "{} is also the id of cluster.members[{first}]: give each member an id of \
                         its own",
                        member.id
                    ),
                ));
            }
            if member.api.is_empty() {
                return Err(invalid(
                    &key("api"),
                    "required: the member's client listener as an http:// or https:// URL, such as \
                     \"http://10.0.0.1:7070\"",
                ));
            }
            let api = api_url(&member.api).map_err(|why| invalid(&key("api"), why))?;
            if let Some(first) = apis.insert(api, at) {
                return Err(invalid(
                    &key("api"),
                    format!(
                        "{:?} is also the api of cluster.members[{first}]: each member has a \
                         client listener of its own",
                        member.api
                    ),
                ));
            }
            if member.peer.is_empty() {
                return Err(invalid(
                    &key("peer"),
                    "required: the member's peer listener as host:port, such as \
                     \"10.0.0.1:7171\" or \"delayd-1.delayd:7171\"",
                ));
            }
            let peer = host_port(&member.peer).map_err(|why| invalid(&key("peer"), why))?;
            if let Some(first) = peers.insert(peer, at) {
                return Err(invalid(
                    &key("peer"),
                    format!(
                        "{:?} is also the peer of cluster.members[{first}]: each member has a peer \
                         listener of its own",
                        member.peer
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// A member's `api`: an `http://` or `https://` URL with a host, a port or its scheme's default, and
/// nothing after them (followers append the request's own path and query). What two spellings of one
/// listener have in common (`http://A` and `http://a:80/`): scheme, lowercase host and port.
pub(crate) fn api_url(text: &str) -> Result<(String, String, u16), String> {
    let example = "such as \"http://10.0.0.1:7070\"";
    let url = reqwest::Url::parse(text)
        .map_err(|e| format!("{text:?} is not a URL ({e}): write one {example}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "{text:?}: use an http:// or https:// URL, {example}"
        ));
    }
    let host = match url.host_str() {
        Some(host) if !host.is_empty() => host.to_ascii_lowercase(),
        _ => return Err(format!("{text:?} has no host: write a URL {example}")),
    };
    if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
        return Err(format!(
            "{text:?} has a path, a query or a fragment: give only the scheme, host and port, \
             {example} (followers add the request's own path)"
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!(
            "{text:?} has a user name or password: give only the scheme, host and port, {example}"
        ));
    }
    let port = url
        .port_or_known_default()
        .ok_or_else(|| format!("{text:?} has no port: write a URL {example}"))?;
    Ok((url.scheme().to_string(), host, port))
}

/// A `host:port` (`10.0.0.1:7171`, `[fd00::1]:7171`, `delayd-1.delayd:7171`): an IP address or a DNS
/// name, and a port other than 0 (the others dial the port they are given). Returns the lowercase
/// host and the port, what two spellings of one address have in common.
pub(crate) fn host_port(text: &str) -> Result<(String, u16), String> {
    let example = "such as \"10.0.0.1:7171\", \"[fd00::1]:7171\" or \"delayd-1.delayd:7171\"";
    let (host, port) = match text.strip_prefix('[') {
        Some(rest) => {
            let (ip, port) = rest
                .split_once("]:")
                .ok_or_else(|| format!("{text:?} is not host:port: write one {example}"))?;
            if ip.parse::<Ipv6Addr>().is_err() {
                return Err(format!(
                    "{text:?}: {ip:?} in brackets is not an IPv6 address; write host:port {example}"
                ));
            }
            (ip, port)
        }
        None => {
            let (host, port) = text
                .rsplit_once(':')
                .ok_or_else(|| format!("{text:?} has no port: write host:port {example}"))?;
            if host.parse::<Ipv6Addr>().is_ok() {
                return Err(format!(
                    "{text:?}: an IPv6 address goes in brackets, such as \"[fd00::1]:7171\""
                ));
            }
            if host.parse::<Ipv4Addr>().is_err() && !dns_name(host) {
                return Err(format!(
                    "{text:?}: {host:?} is neither an IP address nor a host name; write host:port \
                     {example}"
                ));
            }
            (host, port)
        }
    };
    // `u16`'s parser takes a leading `+`, which no resolver does.
    match port.parse::<u16>() {
        Ok(number) if number != 0 && port.bytes().all(|b| b.is_ascii_digit()) => {
            Ok((host.to_ascii_lowercase(), number))
        }
        _ => Err(format!(
            "{text:?}: {port:?} is not a port (1 to 65535); write host:port {example}"
        )),
    }
}

/// Whether `host` is a DNS name: dot-separated labels of 1 to 63 letters, digits, `-` and `_`, none
/// starting or ending with `-`, at most 253 characters (a final dot allowed).
fn dns_name(host: &str) -> bool {
    let name = host.strip_suffix('.').unwrap_or(host);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}
