//! Peer traffic between cluster members (DESIGN.md §10): an authenticated request/response link on a
//! listener of its own (`cluster.listen`), so that client load and the HTTP edge's limits never starve
//! it. What travels over it (Raft's votes, appends and snapshots) is its callers' business: a request
//! is a kind byte and a payload, an answer a payload or an error text. Its user is the cluster's
//! Raft network (`cluster::network`).
//!
//! ```text
//! handshake: the caller proves the secret first, then the member it called does
//!   caller → member  b"DLYDPEER", version u16 LE, caller's id u64 LE, member's id u64 LE (as the
//!                    caller expects it), caller nonce [32]
//!   member → caller  member nonce [32]
//!   caller → member  HMAC-SHA256(secret, "caller" | member nonce | caller nonce | caller id | member id)
//!   member → caller  HMAC-SHA256(secret, "member" | caller nonce | member nonce | caller id | member id)
//! then, one request at a time per connection (a caller keeps a few idle connections per member)
//!   request          len u32 LE (of what follows), kind u8, payload
//!   answer           len u32 LE (of what follows), status u8 (0 ok, 1 error: the payload is its text),
//!                    payload
//! ```
//!
//! Invariants:
//! - A member shows nothing verifiable before its caller proved the secret: a stranger who reaches
//!   the listener learns only a random nonce, so it cannot test guesses of the secret offline. (One
//!   who poses as a member can test them against a caller's proof: the secret must be random, at least
//!   [`MIN_SECRET_BYTES`] long, e.g. `openssl rand -hex 32`.)
//! - Proofs are compared in constant time, cover both sides' fresh nonces (a recorded one is worth
//!   nothing later) and both ids (a caller that reached the wrong member learns it).
//! - Before a caller proved itself, a member reads only the fixed-size handshake, within
//!   [`PeerOptions::handshake_timeout`], and at most [`MAX_HANDSHAKES`] such connections at once
//!   ([`MAX_HANDSHAKES_PER_ADDRESS`] from one address).
//! - A request or answer longer than [`PeerOptions::max_frame_bytes`] is refused before it is sent or
//!   read. Every call has a deadline ([`PeerOptions::request_timeout`]), on both sides; a member closes
//!   a connection idle for [`PeerOptions::idle_timeout`].
//! - A connection whose call failed or timed out is dropped, never reused (it may hold a late answer),
//!   and so are the caller's other idle ones to that member (a member that rebooted or was cut off
//!   left them all stale); an idle one is checked on its socket before reuse.
//! - Dropping the future [`serve`] returns stops its connections too (their tasks are aborted).
//! - Only a connection's setup is authenticated; its frames are neither signed nor encrypted: peer
//!   traffic belongs on a private network.
//! - Both sides of a link must be given the same [`PeerOptions::idle_timeout`].

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MAGIC: &[u8; 8] = b"DLYDPEER";
const VERSION: u16 = 1;
const NONCE_LEN: usize = 32;
const PROOF_LEN: usize = 32;
const HELLO_LEN: usize = 8 + 2 + 8 + 8 + NONCE_LEN;
const STATUS_OK: u8 = 0;
const STATUS_ERROR: u8 = 1;

/// The shortest `cluster.secret` a member takes.
pub const MIN_SECRET_BYTES: usize = 16;

/// The most connections a member lets try the handshake at once; more are closed at once.
pub const MAX_HANDSHAKES: usize = 64;

/// The most of them from one address, so that one stranger cannot hold every handshake (members on
/// one host, each with at most [`PeerOptions::pool`] connections to a member, stay under it).
pub const MAX_HANDSHAKES_PER_ADDRESS: usize = 16;

/// How long peer traffic may take.
#[derive(Debug, Clone)]
pub struct PeerOptions {
    pub connect_timeout: Duration,
    /// For a connection to prove itself, on both sides.
    pub handshake_timeout: Duration,
    /// For one call: its request written and its answer read; on a member, for the answer.
    pub request_timeout: Duration,
    /// A member closes a connection that sent no request for this long; a caller reuses an idle one
    /// for half of it.
    pub idle_timeout: Duration,
    pub max_frame_bytes: usize,
    /// Connections a caller has to one member at most, in use or idle: more calls at once wait.
    pub pool: usize,
}

impl Default for PeerOptions {
    fn default() -> PeerOptions {
        PeerOptions {
            connect_timeout: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            max_frame_bytes: 64 << 20,
            pool: 4,
        }
    }
}

/// What went wrong on the link to a member.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("cluster.secret must have at least {MIN_SECRET_BYTES} bytes")]
    WeakSecret,
    #[error("peer {peer}: {what} timed out after {after:?}")]
    Timeout {
        peer: SocketAddr,
        what: &'static str,
        after: Duration,
    },
    #[error("peer {peer}: {source}")]
    Io {
        peer: SocketAddr,
        source: std::io::Error,
    },
    #[error("peer {peer} refused: {why}")]
    Refused { peer: SocketAddr, why: String },
    #[error("peer {peer}: a request of {bytes} bytes is over max_frame_bytes ({max})")]
    TooLarge {
        peer: SocketAddr,
        bytes: usize,
        max: usize,
    },
    /// The member took the request and answered with an error of its own.
    #[error("peer {peer} answered an error: {text}")]
    Answered { peer: SocketAddr, text: String },
}

/// The secret both sides prove they hold.
#[derive(Clone)]
struct Secret(Arc<[u8]>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// What one handshake's proofs cover besides the role: the nonces in the prover's order, and both ids.
struct Handshake<'a> {
    caller_nonce: &'a [u8],
    member_nonce: &'a [u8],
    caller: u64,
    member: u64,
}

impl Secret {
    fn new(secret: &str) -> Result<Secret, PeerError> {
        match secret.len() >= MIN_SECRET_BYTES {
            true => Ok(Secret(secret.as_bytes().into())),
            false => Err(PeerError::WeakSecret),
        }
    }

    /// The MAC of a role's proof: each role puts the other side's nonce first, so that no proof can be
    /// passed off as the other role's.
    fn mac(&self, caller_proves: bool, hs: &Handshake<'_>) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        match caller_proves {
            true => {
                mac.update(b"caller");
                mac.update(hs.member_nonce);
                mac.update(hs.caller_nonce);
            }
            false => {
                mac.update(b"member");
                mac.update(hs.caller_nonce);
                mac.update(hs.member_nonce);
            }
        }
        mac.update(&hs.caller.to_le_bytes());
        mac.update(&hs.member.to_le_bytes());
        mac
    }

    fn proof(&self, caller_proves: bool, hs: &Handshake<'_>) -> [u8; PROOF_LEN] {
        self.mac(caller_proves, hs).finalize().into_bytes().into()
    }

    /// Whether `proof` is this secret's, compared in constant time.
    fn verify(&self, caller_proves: bool, hs: &Handshake<'_>, proof: &[u8]) -> bool {
        self.mac(caller_proves, hs).verify_slice(proof).is_ok()
    }
}

fn nonce() -> [u8; NONCE_LEN] {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).expect("the OS gives random bytes");
    nonce
}

/// Answers the requests of authenticated callers. A handler's future is dropped when it outlives
/// [`PeerOptions::request_timeout`] or the member stops serving: it must be safe to cancel.
pub trait PeerService: Send + Sync + 'static {
    /// The answer to a request of `kind` from the member `from`, or the error text the caller gets.
    fn handle(
        &self,
        from: u64,
        kind: u8,
        payload: Vec<u8>,
    ) -> futures_core::future::BoxFuture<'_, Result<Vec<u8>, String>>;
}

/// Serves callers on `listener` as the member `id` until the returned future is dropped, which ends
/// its connections too: each connection proves the secret, then its requests go to `service` one at
/// a time. Refuses a secret shorter than [`MIN_SECRET_BYTES`] before anything is served.
pub fn serve(
    listener: TcpListener,
    id: u64,
    secret: &str,
    options: PeerOptions,
    service: Arc<dyn PeerService>,
) -> Result<impl std::future::Future<Output = ()> + Send + 'static, PeerError> {
    let secret = Secret::new(secret)?;
    let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    let proving = Arc::new(Mutex::new(HashMap::new()));
    Ok(async move {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                Some(ended) = connections.join_next(), if !connections.is_empty() => {
                    if let Err(e) = ended.map_err(|e| e.try_into_panic()) {
                        tracing::error!(panic = ?e.ok(), "a peer connection's task panicked");
                    }
                    continue;
                }
            };
            let (stream, addr) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, most likely: wait for some to be let go, not spin.
                    tracing::warn!(error = %e, "accepting a peer connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Some(handshake) = Proving::admit(&handshakes, &proving, addr) else {
                tracing::debug!(peer = %addr, "too many peer connections proving themselves; closed");
                continue;
            };
            let (secret, options, service) = (secret.clone(), options.clone(), service.clone());
            connections.spawn(async move {
                let _ = stream.set_nodelay(true);
                let link = Link {
                    stream,
                    addr,
                    options,
                };
                if let Err(e) = link.serve(id, &secret, handshake, service).await {
                    tracing::debug!(peer = %addr, error = %e, "peer connection ended");
                }
            });
        }
    })
}

/// A connection's place among those proving themselves, given back when it is dropped.
struct Proving {
    _permit: tokio::sync::OwnedSemaphorePermit,
    by_address: Arc<Mutex<HashMap<std::net::IpAddr, usize>>>,
    address: std::net::IpAddr,
}

impl Proving {
    /// A place for a connection from `addr`, if there is one overall and for its address.
    fn admit(
        handshakes: &Arc<tokio::sync::Semaphore>,
        by_address: &Arc<Mutex<HashMap<std::net::IpAddr, usize>>>,
        addr: SocketAddr,
    ) -> Option<Proving> {
        let permit = handshakes.clone().try_acquire_owned().ok()?;
        let mut counts = by_address.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry(addr.ip()).or_insert(0);
        if *count >= MAX_HANDSHAKES_PER_ADDRESS {
            return None;
        }
        *count += 1;
        Some(Proving {
            _permit: permit,
            by_address: by_address.clone(),
            address: addr.ip(),
        })
    }
}

impl Drop for Proving {
    fn drop(&mut self) {
        let mut counts = self.by_address.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = counts.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.address);
            }
        }
    }
}

/// A member's end of one connection.
struct Link {
    stream: TcpStream,
    addr: SocketAddr,
    options: PeerOptions,
}

impl Link {
    fn io(&self) -> impl Fn(std::io::Error) -> PeerError {
        let peer = self.addr;
        move |source| PeerError::Io { peer, source }
    }

    async fn serve(
        mut self,
        id: u64,
        secret: &Secret,
        handshake: Proving,
        service: Arc<dyn PeerService>,
    ) -> Result<(), PeerError> {
        let (addr, after) = (self.addr, self.options.handshake_timeout);
        let from = within(addr, "the handshake", after, self.prove(id, secret)).await?;
        drop(handshake);
        loop {
            let io = self.io();
            let max = self.options.max_frame_bytes;
            let idle = self.options.idle_timeout;
            let Ok(next) = tokio::time::timeout(idle, read_len(&mut self.stream, max)).await else {
                return Ok(()); // idle too long: the caller connects again when it needs to
            };
            let Some(len) = next.map_err(&io)? else {
                return Ok(()); // the caller closed between requests
            };
            let after = self.options.request_timeout;
            let body = async { read_body(&mut self.stream, len).await.map_err(&io) };
            let (kind, payload) = within(addr, "a request", after, body).await?;
            let answered = tokio::time::timeout(after, service.handle(from, kind, payload)).await;
            let (status, answer) = match answered {
                Ok(Ok(answer)) if answer.len() > max => (
                    STATUS_ERROR,
                    format!(
                        "the answer has {} bytes, over max_frame_bytes",
                        answer.len()
                    )
                    .into_bytes(),
                ),
                Ok(Ok(answer)) => (STATUS_OK, answer),
                Ok(Err(text)) => (STATUS_ERROR, text.into_bytes()),
                Err(_) => (
                    STATUS_ERROR,
                    format!("no answer within {after:?}").into_bytes(),
                ),
            };
            let written = write_frame(&mut self.stream, status, &answer);
            within(addr, "an answer", after, async {
                written.await.map_err(io)
            })
            .await?;
        }
    }

    /// The member's side of the handshake: the caller's id once it proved the secret.
    async fn prove(&mut self, id: u64, secret: &Secret) -> Result<u64, PeerError> {
        let io = self.io();
        let refused = |why: String| PeerError::Refused {
            peer: self.addr,
            why,
        };
        let mut hello = [0u8; HELLO_LEN];
        self.stream.read_exact(&mut hello).await.map_err(&io)?;
        if &hello[..8] != MAGIC {
            return Err(refused("not a delayd peer".into()));
        }
        let version = u16::from_le_bytes([hello[8], hello[9]]);
        if version != VERSION {
            return Err(refused(format!(
                "peer protocol version {version}, this member speaks {VERSION}"
            )));
        }
        let caller = u64::from_le_bytes(hello[10..18].try_into().expect("8 bytes"));
        let expected = u64::from_le_bytes(hello[18..26].try_into().expect("8 bytes"));
        let member_nonce = nonce();
        let hs = Handshake {
            caller_nonce: &hello[26..],
            member_nonce: &member_nonce,
            caller,
            member: id,
        };
        self.stream.write_all(&member_nonce).await.map_err(&io)?;
        let mut proof = [0u8; PROOF_LEN];
        self.stream.read_exact(&mut proof).await.map_err(&io)?;
        if expected != id || !secret.verify(true, &hs, &proof) {
            // A wrong id is told apart only in the log: the caller learns nothing but the close.
            tracing::warn!(peer = %self.addr, caller, expected, id, "a peer connection did not prove cluster.secret for this member; closed");
            return Err(refused("no proof of cluster.secret for this member".into()));
        }
        let proof = secret.proof(false, &hs);
        self.stream.write_all(&proof).await.map_err(&io)?;
        Ok(caller)
    }
}

/// Reads one frame: `None` if the stream ended before it began.
async fn read_frame(stream: &mut TcpStream, max: usize) -> std::io::Result<Option<(u8, Vec<u8>)>> {
    match read_len(stream, max).await? {
        Some(len) => read_body(stream, len).await.map(Some),
        None => Ok(None),
    }
}

/// Reads a frame's length: `None` if the stream ended before it (not within it).
async fn read_len(stream: &mut TcpStream, max: usize) -> std::io::Result<Option<usize>> {
    let mut len = [0u8; 4];
    if stream.read(&mut len[..1]).await? == 0 {
        return Ok(None);
    }
    stream.read_exact(&mut len[1..]).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len - 1 > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes (its payload may have at most {max})"),
        ));
    }
    Ok(Some(len))
}

/// Reads the kind and payload of a frame of `len` bytes.
async fn read_body(stream: &mut TcpStream, len: usize) -> std::io::Result<(u8, Vec<u8>)> {
    let kind = stream.read_u8().await?;
    let mut payload = vec![0u8; len - 1];
    stream.read_exact(&mut payload).await?;
    Ok((kind, payload))
}

async fn write_frame(stream: &mut TcpStream, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(payload.len() + 1)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a frame over 4 GiB"))?;
    let mut frame = Vec::with_capacity(5 + payload.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.push(kind);
    frame.extend_from_slice(payload);
    stream.write_all(&frame).await
}

async fn within<T>(
    peer: SocketAddr,
    what: &'static str,
    after: Duration,
    work: impl std::future::Future<Output = Result<T, PeerError>>,
) -> Result<T, PeerError> {
    tokio::time::timeout(after, work)
        .await
        .unwrap_or(Err(PeerError::Timeout { peer, what, after }))
}

/// Whether an idle connection is still open: asked of its socket (tokio's readiness may not have seen
/// the member's close yet), without taking a byte. An idle connection has nothing to read, so any
/// byte, end or error means it is not fit for a call.
fn still_open(stream: &TcpStream) -> bool {
    let mut byte = [std::mem::MaybeUninit::uninit()];
    let peeked = socket2::SockRef::from(stream).peek(&mut byte);
    matches!(peeked, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// Calls one member: connects and proves the secret when it has no idle connection, keeps a few.
#[derive(Debug)]
pub struct PeerClient {
    peer: SocketAddr,
    /// This member's id, which the called member is told.
    id: u64,
    /// The called member's id, which it proves.
    member: u64,
    secret: Secret,
    options: PeerOptions,
    /// Idle connections, each with when it was last used.
    idle: Mutex<Vec<(TcpStream, Instant)>>,
    /// One permit per connection it may have ([`PeerOptions::pool`]), held by each call.
    slots: tokio::sync::Semaphore,
}

impl PeerClient {
    /// A caller with the id `id` of the member `member` at `peer`.
    pub fn new(
        peer: SocketAddr,
        id: u64,
        member: u64,
        secret: &str,
        options: PeerOptions,
    ) -> Result<PeerClient, PeerError> {
        Ok(PeerClient {
            peer,
            id,
            member,
            secret: Secret::new(secret)?,
            slots: tokio::sync::Semaphore::new(options.pool.max(1)),
            options,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Sends a request of `kind` and waits for its answer.
    pub async fn call(&self, kind: u8, payload: &[u8]) -> Result<Vec<u8>, PeerError> {
        let (peer, max) = (self.peer, self.options.max_frame_bytes);
        if payload.len() > max {
            let bytes = payload.len();
            return Err(PeerError::TooLarge { peer, bytes, max });
        }
        let after = self.options.request_timeout;
        let _slot = within(peer, "waiting for a connection", after, async {
            Ok(self
                .slots
                .acquire()
                .await
                .expect("the semaphore is never closed"))
        })
        .await?;
        let mut stream = match self.take_idle() {
            Some(stream) => stream,
            None => self.connect().await?,
        };
        let io = |source| PeerError::Io { peer, source };
        let exchanged = within(peer, "a request", self.options.request_timeout, async {
            write_frame(&mut stream, kind, payload).await.map_err(io)?;
            match read_frame(&mut stream, max).await.map_err(io)? {
                Some(answer) => Ok(answer),
                None => Err(io(std::io::ErrorKind::UnexpectedEof.into())),
            }
        })
        .await;
        let (status, answer) = exchanged.inspect_err(|_| {
            // What broke this connection (a reboot, a cut link) has most likely broken the idle ones.
            self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
        })?;
        let answer = match status {
            STATUS_OK => Ok(answer),
            STATUS_ERROR => Err(PeerError::Answered {
                peer,
                text: String::from_utf8_lossy(&answer).into_owned(),
            }),
            other => {
                let what = format!("an answer of status {other}");
                return Err(io(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    what,
                )));
            }
        };
        // Only a connection whose call ended cleanly goes back to the pool.
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.push((stream, Instant::now()));
        answer
    }

    /// The most recently used idle connection that is still open and not near the member's idle
    /// timeout; the others are dropped.
    fn take_idle(&self) -> Option<TcpStream> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        while let Some((stream, used)) = idle.pop() {
            if used.elapsed() < self.options.idle_timeout / 2 && still_open(&stream) {
                return Some(stream);
            }
        }
        None
    }

    async fn connect(&self) -> Result<TcpStream, PeerError> {
        let peer = self.peer;
        let io = |source| PeerError::Io { peer, source };
        let mut stream = within(peer, "connecting", self.options.connect_timeout, async {
            TcpStream::connect(peer).await.map_err(io)
        })
        .await?;
        let _ = stream.set_nodelay(true);
        within(peer, "the handshake", self.options.handshake_timeout, async {
            let caller_nonce = nonce();
            let mut hello = Vec::with_capacity(HELLO_LEN);
            hello.extend_from_slice(MAGIC);
            hello.extend_from_slice(&VERSION.to_le_bytes());
            hello.extend_from_slice(&self.id.to_le_bytes());
            hello.extend_from_slice(&self.member.to_le_bytes());
            hello.extend_from_slice(&caller_nonce);
            stream.write_all(&hello).await.map_err(io)?;
            let mut member_nonce = [0u8; NONCE_LEN];
            stream.read_exact(&mut member_nonce).await.map_err(io)?;
            let hs = Handshake {
                caller_nonce: &caller_nonce,
                member_nonce: &member_nonce,
                caller: self.id,
                member: self.member,
            };
            stream.write_all(&self.secret.proof(true, &hs)).await.map_err(io)?;
            let mut proof = [0u8; PROOF_LEN];
            match stream.read_exact(&mut proof).await {
                Ok(_) if self.secret.verify(false, &hs, &proof) => Ok(()),
                Ok(_) => Err(PeerError::Refused {
                    peer,
                    why: "it did not prove cluster.secret".into(),
                }),
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(PeerError::Refused {
                    peer,
                    why: format!(
                        "it closed on this member's proof: another cluster.secret, or not member {}",
                        self.member
                    ),
                }),
                Err(e) => Err(io(e)),
            }
        })
        .await?;
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_core::future::BoxFuture;

    const SECRET: &str = "a long random string";
    const MEMBER: u64 = 1;

    /// Answers kind 0 with the caller's id and the payload, kind 1 with an error, kind 2 never.
    struct Echo;

    impl PeerService for Echo {
        fn handle(
            &self,
            from: u64,
            kind: u8,
            payload: Vec<u8>,
        ) -> BoxFuture<'_, Result<Vec<u8>, String>> {
            Box::pin(async move {
                match kind {
                    0 => Ok([from.to_le_bytes().as_slice(), &payload].concat()),
                    1 => Err("refused on purpose".into()),
                    _ => std::future::pending().await,
                }
            })
        }
    }

    /// Generous deadlines: only a test that waits for a timeout on purpose sets a short one.
    fn options() -> PeerOptions {
        PeerOptions {
            max_frame_bytes: 1024,
            ..PeerOptions::default()
        }
    }

    /// Member 1 serving [`Echo`] on `listener` (a free loopback port if `None`), until the handle is
    /// aborted or the test ends.
    async fn member(
        listener: Option<TcpListener>,
        options: PeerOptions,
    ) -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = match listener {
            Some(listener) => listener,
            None => TcpListener::bind("127.0.0.1:0").await.unwrap(),
        };
        let addr = listener.local_addr().unwrap();
        let served = serve(listener, MEMBER, SECRET, options, Arc::new(Echo)).unwrap();
        (addr, tokio::spawn(served))
    }

    fn caller(addr: SocketAddr, secret: &str) -> PeerClient {
        PeerClient::new(addr, 7, MEMBER, secret, options()).unwrap()
    }

    fn local_ports(client: &PeerClient) -> Vec<u16> {
        let idle = client.idle.lock().unwrap();
        let mut ports: Vec<u16> = idle
            .iter()
            .map(|(s, _)| s.local_addr().unwrap().port())
            .collect();
        ports.sort_unstable();
        ports
    }

    /// The member closes `raw` having sent it exactly `expected` bytes (a reset counts as a close: it
    /// closes with unread bytes).
    async fn assert_closed_after(mut raw: TcpStream, expected: usize) {
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), raw.read_to_end(&mut got)).await;
        let reset = |e: &std::io::Error| e.kind() == std::io::ErrorKind::ConnectionReset;
        match read {
            Ok(Ok(_)) => {}
            Ok(Err(e)) if reset(&e) => {}
            other => panic!("not closed: {other:?}"),
        }
        assert_eq!(got.len(), expected, "{got:?}");
    }

    fn hello(caller: u64, member: u64) -> Vec<u8> {
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&VERSION.to_le_bytes());
        hello.extend_from_slice(&caller.to_le_bytes());
        hello.extend_from_slice(&member.to_le_bytes());
        hello.extend_from_slice(&[0u8; NONCE_LEN]);
        hello
    }

    #[tokio::test]
    async fn an_authenticated_caller_gets_its_answers_and_reuses_its_connections() {
        let (addr, _served) = member(None, options()).await;
        let client = Arc::new(caller(addr, SECRET));
        let calls = (0..16u8).map(|i| {
            let client = client.clone();
            tokio::spawn(async move { (i, client.call(0, &[i; 3]).await) })
        });
        for call in calls {
            let (i, answer) = call.await.unwrap();
            let answer = answer.unwrap();
            assert_eq!(
                answer[..8],
                7u64.to_le_bytes(),
                "the member knows who called"
            );
            assert_eq!(answer[8..], [i; 3]);
        }
        let pooled = local_ports(&client);
        assert!(
            (1..=options().pool).contains(&pooled.len()),
            "16 calls at once share at most `pool` connections: {pooled:?}"
        );
        for i in 0..10u8 {
            assert_eq!(client.call(0, &[i]).await.unwrap()[8..], [i]);
        }
        assert_eq!(
            local_ports(&client),
            pooled,
            "calls one at a time reuse the pooled connections"
        );
        match client.call(1, b"x").await {
            Err(PeerError::Answered { text, .. }) => assert_eq!(text, "refused on purpose"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            local_ports(&client),
            pooled,
            "an error answer keeps its connection"
        );
    }

    #[tokio::test]
    async fn a_stranger_learns_nothing_it_could_test_a_guess_against() {
        let (addr, _served) = member(None, options()).await;
        let stranger = caller(addr, "another long random string");
        match stranger.call(0, b"x").await {
            Err(PeerError::Refused { why, .. }) => assert!(why.contains("closed on"), "{why}"),
            other => panic!("{other:?}"),
        }
        // By hand: the member sends its nonce, and after a wrong proof closes without another byte.
        let mut raw = TcpStream::connect(addr).await.unwrap();
        raw.write_all(&hello(7, MEMBER)).await.unwrap();
        let mut member_nonce = [0u8; NONCE_LEN];
        raw.read_exact(&mut member_nonce).await.unwrap();
        raw.write_all(&[0u8; PROOF_LEN]).await.unwrap();
        assert_closed_after(raw, 0).await;
        // A caller that expects another member is refused though it holds the secret.
        let wrong = PeerClient::new(addr, 7, MEMBER + 1, SECRET, options()).unwrap();
        match wrong.call(0, b"x").await {
            Err(PeerError::Refused { why, .. }) => assert!(why.contains("not member 2"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_member_that_is_not_what_it_claims_is_refused() {
        // A listener that answers the hello with a nonce and then a proof it cannot make.
        let fake = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = fake.local_addr().unwrap();
        let faking = tokio::spawn(async move {
            let (mut stream, _) = fake.accept().await.unwrap();
            let mut hello = [0u8; HELLO_LEN];
            stream.read_exact(&mut hello).await.unwrap();
            stream.write_all(&[1u8; NONCE_LEN]).await.unwrap();
            let mut proof = [0u8; PROOF_LEN];
            stream.read_exact(&mut proof).await.unwrap();
            stream.write_all(&proof).await.unwrap(); // the caller's own proof, reflected
            stream
        });
        match caller(addr, SECRET).call(0, b"x").await {
            Err(PeerError::Refused { why, .. }) => assert!(why.contains("did not prove"), "{why}"),
            other => panic!("{other:?}"),
        }
        drop(faking.await.unwrap());
    }

    /// A member that holds the secret but proves itself as `proves_as` whatever it was asked for,
    /// and answers its one request with `status`.
    async fn forged_member(proves_as: u64, status: u8) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut hello = [0u8; HELLO_LEN];
            stream.read_exact(&mut hello).await.unwrap();
            let member_nonce = nonce();
            stream.write_all(&member_nonce).await.unwrap();
            let mut proof = [0u8; PROOF_LEN];
            stream.read_exact(&mut proof).await.unwrap();
            let hs = Handshake {
                caller_nonce: &hello[26..],
                member_nonce: &member_nonce,
                caller: u64::from_le_bytes(hello[10..18].try_into().unwrap()),
                member: proves_as,
            };
            let secret = Secret::new(SECRET).unwrap();
            stream.write_all(&secret.proof(false, &hs)).await.unwrap();
            if let Ok(Some(_)) = read_frame(&mut stream, 1024).await {
                let _ = write_frame(&mut stream, status, b"?").await;
            }
            // Held open until the caller is done with it.
            let _ = stream.read_to_end(&mut Vec::new()).await;
        });
        addr
    }

    #[tokio::test]
    async fn a_member_with_the_secret_must_still_be_the_one_called_and_speak_the_protocol() {
        let impostor = forged_member(MEMBER + 1, STATUS_OK).await;
        match caller(impostor, SECRET).call(0, b"x").await {
            Err(PeerError::Refused { why, .. }) => assert!(why.contains("did not prove"), "{why}"),
            other => panic!("member 2 answering for member 1: {other:?}"),
        }
        let garbled = forged_member(MEMBER, 2).await;
        let client = caller(garbled, SECRET);
        match client.call(0, b"x").await {
            Err(PeerError::Io { source, .. }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::InvalidData, "{source}")
            }
            other => panic!("an answer of an unknown status: {other:?}"),
        }
        assert!(
            local_ports(&client).is_empty(),
            "its connection is not kept"
        );
    }

    #[tokio::test]
    async fn a_short_secret_is_refused_at_the_start() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let short = "x".repeat(MIN_SECRET_BYTES - 1);
        let served = serve(listener, MEMBER, &short, options(), Arc::new(Echo));
        assert!(matches!(served, Err(PeerError::WeakSecret)));
        let client = PeerClient::new(addr, 7, MEMBER, &short, options());
        assert!(matches!(client, Err(PeerError::WeakSecret)));
        assert!(PeerClient::new(addr, 7, MEMBER, &"x".repeat(MIN_SECRET_BYTES), options()).is_ok());
    }

    #[tokio::test]
    async fn silence_ends_in_a_timeout_on_both_sides() {
        let short = PeerOptions {
            handshake_timeout: Duration::from_millis(300),
            request_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_millis(300),
            ..options()
        };
        let (addr, _served) = member(None, short.clone()).await;
        // The member gives up on a handler that does not answer, and says so.
        let patient = caller(addr, SECRET);
        match patient.call(2, b"x").await {
            Err(PeerError::Answered { text, .. }) => {
                assert!(text.contains("no answer within"), "{text}")
            }
            other => panic!("{other:?}"),
        }
        // A caller that waits less than its member gives up first, and keeps no connection.
        let (patient_member, _served) = member(None, options()).await;
        let hasty = PeerClient::new(
            patient_member,
            7,
            MEMBER,
            SECRET,
            PeerOptions {
                request_timeout: Duration::from_millis(100),
                ..options()
            },
        )
        .unwrap();
        match hasty.call(2, b"x").await {
            Err(PeerError::Timeout { what, .. }) => assert_eq!(what, "a request"),
            other => panic!("{other:?}"),
        }
        assert!(
            local_ports(&hasty).is_empty(),
            "a timed-out connection is not kept"
        );
        // A listener that accepts and says nothing: the handshake times out.
        let mute = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = PeerClient::new(mute.local_addr().unwrap(), 7, MEMBER, SECRET, short).unwrap();
        match client.call(0, b"x").await {
            Err(PeerError::Timeout { what, .. }) => assert_eq!(what, "the handshake"),
            other => panic!("{other:?}"),
        }
        // A connection that never proves itself is closed by the member, and so is an idle one.
        assert_closed_after(TcpStream::connect(addr).await.unwrap(), 0).await;
        let idle = caller(addr, SECRET);
        idle.call(0, b"x").await.unwrap();
        let (stream, _) = idle.idle.lock().unwrap().pop().unwrap();
        assert_closed_after(stream, 0).await;
    }

    /// Waits until the member closed the caller's pooled connection.
    async fn until_pooled_closed(client: &PeerClient) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while client
            .idle
            .lock()
            .unwrap()
            .iter()
            .any(|(s, _)| still_open(s))
        {
            assert!(
                Instant::now() < deadline,
                "the pooled connection stays open"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restarted_member_is_called_on_new_connections() {
        let (addr, served) = member(None, options()).await;
        let client = caller(addr, SECRET);
        client.call(0, b"before").await.unwrap();
        served.abort();
        let _ = served.await;
        // Its connections end with it: the pooled one is found closed before it is reused.
        until_pooled_closed(&client).await;
        let listener = TcpListener::bind(addr).await.unwrap();
        let (_, _served) = member(Some(listener), options()).await;
        assert_eq!(client.call(0, b"after").await.unwrap()[8..], *b"after");
        assert_eq!(
            local_ports(&client).len(),
            1,
            "the stale connection is gone"
        );
    }

    #[tokio::test]
    async fn one_address_holds_at_most_a_few_handshakes() {
        let slow = PeerOptions {
            handshake_timeout: Duration::from_secs(60),
            ..options()
        };
        let (addr, _served) = member(None, slow).await;
        let mut silent = Vec::new();
        for _ in 0..MAX_HANDSHAKES_PER_ADDRESS {
            silent.push(TcpStream::connect(addr).await.unwrap());
        }
        // One more from the same address is closed at once, long before its handshake would time out.
        assert_closed_after(TcpStream::connect(addr).await.unwrap(), 0).await;
        assert!(
            silent.iter().all(still_open),
            "the first ones wait for their handshake"
        );
        // Once one of them goes, a caller proves itself again.
        drop(silent.pop());
        let client = caller(addr, SECRET);
        let deadline = Instant::now() + Duration::from_secs(10);
        while client.call(0, b"x").await.is_err() {
            assert!(Instant::now() < deadline, "no place freed for a handshake");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn strangers_and_frames_over_the_limit_are_refused() {
        let (addr, _served) = member(None, options()).await;
        let mut raw = TcpStream::connect(addr).await.unwrap();
        let mut http = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        http.resize(HELLO_LEN, b' ');
        raw.write_all(&http).await.unwrap();
        assert_closed_after(raw, 0).await;
        let client = caller(addr, SECRET);
        let max = options().max_frame_bytes;
        match client.call(0, &vec![0u8; max + 1]).await {
            Err(PeerError::TooLarge { bytes, .. }) => assert_eq!(bytes, max + 1),
            other => panic!("{other:?}"),
        }
        // The answer carries 8 more bytes than the request: at the limit, it is refused by the member.
        assert_eq!(
            client.call(0, &vec![0u8; max - 8]).await.unwrap().len(),
            max
        );
        match client.call(0, &vec![0u8; max]).await {
            Err(PeerError::Answered { text, .. }) => {
                assert!(text.contains("over max_frame_bytes"), "{text}")
            }
            other => panic!("{other:?}"),
        }
        // A frame over the limit sent by hand ends the connection: the member does not read it.
        let mut authed = client.take_idle().expect("a pooled connection");
        authed
            .write_all(&(max as u32 + 2).to_le_bytes())
            .await
            .unwrap();
        assert_closed_after(authed, 0).await;
    }
}
