//! The `delayd` command: `serve` runs the service; `send`, `tail`, `schedule` and `inspect` are tools
//! around it.

use anyhow::{bail, Context};
use base64::Engine;
use clap::{Args, Parser, Subcommand};
use delayd::config::{Config, Flags, LogFormat};
use serde_json::{json, Value};
use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "delayd",
    version,
    about = "A durable, millisecond-precise delay / scheduled-message service"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the service (embedded defaults: data in ./data, listening on 127.0.0.1:7070)
    Serve(ServeArgs),
    /// Schedule one message through the HTTP API
    Send(SendArgs),
    /// Print the messages of a broker topic as they arrive, one JSON object per line (the pulled
    /// message, with its queue)
    Tail(TailArgs),
    /// Dump a data file (WAL, schedule segment or index, dispatch log, checkpoint, meta; the broker's
    /// commit log, consume queues, checkpoints, group offsets) and verify its checksums
    Inspect {
        /// The file to read
        path: PathBuf,
    },
    /// Exit 0 when the service answers GET /readyz with 200 (recovered, storage working; a full
    /// disk still answers 200), 1 otherwise: a container health check that needs no curl
    Probe(ProbeArgs),
    /// A cluster's members: show them, add one, remove one (through any member's HTTP API)
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Recurring schedules: create or replace one, list them, pause, resume or delete one (through
    /// the HTTP API)
    #[command(subcommand)]
    Schedule(ScheduleCommand),
}

#[derive(Debug, Subcommand)]
enum ScheduleCommand {
    /// Create schedule ID or replace its definition (a paused one stays paused); prints the
    /// schedule as answered, and says on stderr whether it was created or replaced
    Put(Box<SchedulePutArgs>),
    /// Every schedule, by id: one line each (reads every page)
    List {
        #[command(flatten)]
        client: Client,
        /// Schedules per request, 1 to 1000
        #[arg(long)]
        limit: Option<u32>,
        /// A JSON array of the schedules as the API answers them, instead of the table
        #[arg(long)]
        json: bool,
    },
    /// Pause a schedule: nothing fires after the answer (its planned firing is withdrawn)
    Pause {
        #[command(flatten)]
        client: Client,
        id: String,
    },
    /// Resume a paused schedule: it plans afresh from now (firings missed while paused are not made)
    Resume {
        #[command(flatten)]
        client: Client,
        id: String,
    },
    /// Delete a schedule: nothing fires after the answer
    Delete {
        #[command(flatten)]
        client: Client,
        id: String,
    },
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("timing").required(true)))]
#[command(group(clap::ArgGroup::new("payload").required(true)))]
struct SchedulePutArgs {
    #[command(flatten)]
    client: Client,
    /// The schedule's id: 1 to 200 of A-Z a-z 0-9 . _ -, not only dots
    id: String,
    /// A cron pattern: 5 fields (minute first) or 6 (second first), with day and month names, or
    /// @hourly, @daily, @weekly, @monthly, @yearly; e.g. "0 9 * * MON-FRI"
    #[arg(long, group = "timing")]
    cron: Option<String>,
    /// A fixed interval instead, at least 1s: e.g. 30s, 5m, 1h (its phase from --start-at, or from
    /// now)
    #[arg(long, group = "timing")]
    every: Option<String>,
    /// The IANA time zone whose wall clock the cron pattern follows, e.g. Europe/Berlin (default UTC)
    #[arg(long)]
    tz: Option<String>,
    /// Each firing's topic
    #[arg(long)]
    topic: String,
    /// Each firing's body, as text
    #[arg(long, group = "payload")]
    body: Option<String>,
    /// Each firing's body, in standard base64
    #[arg(long, group = "payload")]
    body_base64: Option<String>,
    /// Each firing's body, read from a file ("-" reads standard input): sent as text when it is
    /// UTF-8, in base64 otherwise
    #[arg(long, group = "payload")]
    body_file: Option<PathBuf>,
    /// Each firing's headers: name=value (repeatable)
    #[arg(long = "header")]
    headers: Vec<String>,
    /// Each firing's key, as a message's
    #[arg(long)]
    key: Option<String>,
    /// Each firing's sink (default: broker)
    #[arg(long)]
    sink: Option<String>,
    /// No firing before it: RFC 3339 (e.g. 2026-12-01T09:00:00Z) or unix milliseconds
    #[arg(long)]
    start_at: Option<String>,
    /// No firing after it (inclusive): RFC 3339 or unix milliseconds
    #[arg(long)]
    end_at: Option<String>,
    /// What a node that was down does with the firings it missed: none (skip them), one (one
    /// firing for all; the default), all (each, oldest first)
    #[arg(long, value_parser = ["none", "one", "all"])]
    catchup: Option<String>,
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// The cluster as the member at --url sees it: its leader, term, indexes and members
    Status {
        #[command(flatten)]
        client: Client,
    },
    /// Add a member (started with `join = true`): a learner until it has caught up, then a voter.
    /// Waits while it catches up, up to --wait
    Add {
        #[command(flatten)]
        client: Client,
        /// The member's id: a whole number above 0, no other member's
        #[arg(long)]
        id: u64,
        /// Its client listener, http://host:port
        #[arg(long)]
        api: String,
        /// Its peer listener as the others reach it, host:port
        #[arg(long)]
        peer: String,
        /// How long to wait for it to catch up, at most
        #[arg(long, default_value = "10m")]
        wait: String,
    },
    /// Remove a member (a voter or a learner); the leader may remove itself
    Remove {
        #[command(flatten)]
        client: Client,
        /// The member's id
        id: u64,
    },
}

#[derive(Debug, Args)]
struct ProbeArgs {
    /// The address the service listens on (a wildcard such as 0.0.0.0 is probed on loopback)
    #[arg(long, env = "DELAYD_LISTEN", default_value = "127.0.0.1:7070")]
    listen: String,
    /// The service's URL instead, as for `send` and `tail` (e.g. https://delayd.internal:7070; its
    /// /readyz is probed; a URL with a path is probed as it is)
    #[arg(long, env = "DELAYD_URL")]
    url: Option<String>,
    /// How long to wait for the answer, e.g. 2s
    #[arg(long, default_value = "5s")]
    timeout: String,
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// TOML configuration file
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Address to listen on, e.g. 127.0.0.1:7070 (port 0 picks a free one)
    #[arg(long)]
    listen: Option<String>,
    /// "always" or an interval such as "5ms"
    #[arg(long)]
    fsync: Option<String>,
    #[arg(long)]
    segment_minutes: Option<u16>,
    /// text or json
    #[arg(long, value_parser = ["text", "json"])]
    log_format: Option<String>,
    /// A bearer token accepted on /v1/* (repeatable); turns authentication on
    #[arg(long = "auth-token")]
    auth_tokens: Vec<String>,
}

#[derive(Debug, Args)]
struct Client {
    /// The service's address
    #[arg(long, env = "DELAYD_URL", default_value = "http://127.0.0.1:7070")]
    url: String,
    /// Bearer token, when the service has authentication on
    #[arg(long, env = "DELAYD_TOKEN")]
    token: Option<String>,
}

#[derive(Debug, Args)]
struct SendArgs {
    #[command(flatten)]
    client: Client,
    #[arg(long)]
    topic: String,
    /// e.g. 30s, 5m, 2h, 7d
    #[arg(long, group = "when")]
    delay: Option<String>,
    /// RFC 3339, e.g. 2026-12-01T09:30:00Z
    #[arg(long, group = "when")]
    deliver_at: Option<String>,
    /// RocketMQ delay level, 1..=18
    #[arg(long, group = "when")]
    delay_level: Option<u32>,
    #[arg(long)]
    key: Option<String>,
    /// name=value (repeatable)
    #[arg(long = "header")]
    headers: Vec<String>,
    #[arg(long)]
    sink: Option<String>,
    /// The message body; "-" reads standard input
    body: String,
}

#[derive(Debug, Args)]
struct TailArgs {
    #[command(flatten)]
    client: Client,
    #[arg(long)]
    topic: String,
    /// One queue; all queues when absent
    #[arg(long)]
    queue: Option<u32>,
    /// Where to start in the queues the group has no offset for. end: the messages that arrive after
    /// tail starts (for a topic that does not exist yet, every message from its first); beginning: also
    /// what the queues already hold
    #[arg(long, value_enum, default_value_t = Start::End)]
    from: Start,
    /// The older spelling of --from beginning
    #[arg(long, hide = true, conflicts_with = "from")]
    from_beginning: bool,
    /// Consumer group: start from its offsets and commit them as messages are printed
    #[arg(long)]
    group: Option<String>,
    /// Exit after this many messages
    #[arg(long)]
    count: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Start {
    Beginning,
    End,
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // The cause chain on one line; no backtrace: these are operator-facing messages.
            eprintln!("delayd: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => serve(args),
        Command::Send(args) => send(args),
        Command::Tail(args) => tail(args),
        Command::Probe(args) => probe(args),
        Command::Cluster(command) => cluster(command),
        Command::Schedule(command) => schedule(command),
        Command::Inspect { path } => {
            let out = &mut std::io::stdout().lock();
            let clean = match delayd::broker::inspect(&path, out) {
                Ok(Some(clean)) => Ok(clean),
                Ok(None) => schedulelog::inspect(&path, out),
                Err(e) => Err(e),
            }
            .with_context(|| format!("reading {}", path.display()))?;
            if !clean {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let flags = Flags {
        data_dir: args.data_dir,
        listen: args.listen,
        fsync: args.fsync,
        segment_minutes: args.segment_minutes,
        log_format: args.log_format.as_deref().map(|f| {
            if f == "json" {
                LogFormat::Json
            } else {
                LogFormat::Text
            }
        }),
        auth_tokens: args.auth_tokens,
    };
    let env = std::env::vars()
        .filter(|(k, _)| k.starts_with("DELAYD_") && k != "DELAYD_URL" && k != "DELAYD_TOKEN");
    let config = Config::load(args.config.as_deref(), env, &flags)?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,openraft=warn".into());
    match config.log_format {
        // Colours only for a terminal: journald, files and log shippers get plain text.
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init(),
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        // Scripts and tests read this line to learn the port when listening on port 0. It comes before
        // recovery: readiness is the line below, and GET /readyz.
        println!("delayd listening on http://{}", listener.local_addr()?);
        raise_fd_limit();
        delayd::run_with_ready(
            config,
            listener,
            std::sync::Arc::new(schedulelog::SystemClock),
            |ready| {
                println!("delayd ready on http://{}", ready.address);
                delayd::notify::notify("READY=1");
            },
            async {
                shutdown_signal().await;
                delayd::notify::notify("STOPPING=1");
            },
        )
        .await
    })
}

/// Raises the open-file limit's soft value to its hard one, and says what it is: every connection and
/// every open storage file takes a descriptor (see `delayd::edge::fds`). Logged after the address line,
/// which scripts read first.
fn raise_fd_limit() {
    match delayd::edge::fds::raise_limit() {
        Ok(raised) if raised.after > raised.before => tracing::info!(
            from = raised.before,
            to = raised.after,
            "raised the open-file limit (RLIMIT_NOFILE) to its hard limit"
        ),
        Ok(raised) => tracing::info!(
            limit = raised.after,
            "the open-file limit (RLIMIT_NOFILE) is at its hard limit"
        ),
        Err(error) => {
            tracing::warn!(%error, "the open-file limit (RLIMIT_NOFILE) could not be raised")
        }
    }
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = interrupt => {},
        _ = async { match terminate.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => {},
    }
}

/// GET /readyz once: Ok when it answers 200.
fn probe(args: ProbeArgs) -> anyhow::Result<()> {
    let url = match args.url {
        Some(url) => readyz_url(&url)?,
        None => {
            let mut address: std::net::SocketAddr = args.listen.parse().with_context(|| {
                format!("--listen {:?} is not an IP address and port", args.listen)
            })?;
            if address.ip().is_unspecified() {
                address.set_ip(match address {
                    std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                });
            }
            format!("http://{address}/readyz")
        }
    };
    let timeout = delayd::config::parse_duration(&args.timeout)
        .map_err(|e| anyhow::anyhow!("--timeout {:?}: {e}", args.timeout))?;
    // No proxy: the probe asks this host's own service, whatever HTTP_PROXY the container has.
    let response = reqwest::blocking::Client::builder()
        .timeout(timeout)
        .no_proxy()
        .build()
        .context("building the HTTP client")?
        .get(&url)
        .send()
        .with_context(|| format!("GET {url}"))?;
    let status = response.status();
    let body = response.text().unwrap_or_default();
    if status != reqwest::StatusCode::OK {
        bail!("GET {url}: HTTP {status}: {}", body.trim());
    }
    println!("{}", body.trim());
    Ok(())
}

/// `/readyz` of the service at `url`; a URL that names a path already is taken as it is.
fn readyz_url(url: &str) -> anyhow::Result<String> {
    let parsed = reqwest::Url::parse(url).with_context(|| format!("--url {url:?} is not a URL"))?;
    Ok(match parsed.path() {
        "" | "/" => parsed.join("/readyz")?.to_string(),
        _ => url.to_string(),
    })
}

/// The CLI's HTTP client: the webhooks' (reqwest), in its blocking form.
fn agent() -> anyhow::Result<reqwest::blocking::Client> {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .context("building the HTTP client")
}

/// Sends a request and returns the status and the JSON answer (Null when the body is not JSON).
fn exchange(
    client: &Client,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> anyhow::Result<(u16, Value)> {
    let url = format!("{}{path}", client.url.trim_end_matches('/'));
    let agent = agent()?;
    let mut request = match (method, body) {
        ("GET", _) => agent.get(&url),
        ("PUT", Some(body)) => agent.put(&url).json(body),
        ("DELETE", None) => agent.delete(&url),
        ("POST", None) => agent.post(&url),
        (_, Some(body)) => agent.post(&url).json(body),
        _ => bail!("unsupported request"),
    };
    if let Some(token) = &client.token {
        request = request.bearer_auth(token);
    }
    let response = request.send().with_context(|| format!("{method} {url}"))?;
    let status = response.status().as_u16();
    let value: Value = response.json().unwrap_or(Value::Null);
    Ok((status, value))
}

/// Sends a request and returns the JSON answer, or fails with the problem's detail.
fn call(client: &Client, method: &str, path: &str, body: Option<&Value>) -> anyhow::Result<Value> {
    let (status, value) = exchange(client, method, path, body)?;
    if !(200..300).contains(&status) {
        return Err(problem(method, path, status, &value));
    }
    Ok(value)
}

fn problem(method: &str, path: &str, status: u16, value: &Value) -> anyhow::Error {
    let detail = value["detail"].as_str().unwrap_or("no detail");
    let code = value["code"].as_str().unwrap_or("?");
    anyhow::anyhow!("{method} {path}: {status} {code}: {detail}")
}

/// `(min_offset, max_offset)` of each queue of a topic; None while the topic does not exist (it does once
/// a message was delivered to it).
fn queue_offsets(client: &Client, topic: &str) -> anyhow::Result<Option<Vec<(u64, u64)>>> {
    let path = format!("/v1/topics/{topic}");
    let (status, info) = exchange(client, "GET", &path, None)?;
    match status {
        404 => Ok(None),
        200 => Ok(Some(
            info["queues"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|q| {
                    let offset = |name: &str| q[name].as_u64().unwrap_or(0);
                    (offset("min_offset"), offset("max_offset"))
                })
                .collect(),
        )),
        _ => Err(problem("GET", &path, status, &info)),
    }
}

fn cluster(command: ClusterCommand) -> anyhow::Result<()> {
    let status = match command {
        ClusterCommand::Status { client } => call(&client, "GET", "/v1/cluster", None)?,
        ClusterCommand::Add {
            client,
            id,
            api,
            peer,
            wait,
        } => {
            let wait = delayd::config::parse_duration(&wait)
                .map_err(|e| anyhow::anyhow!("--wait {wait:?}: {e}"))?;
            let deadline = std::time::Instant::now() + wait;
            let member = json!({"id": id, "api": api, "peer": peer});
            loop {
                let (status, answer) =
                    exchange(&client, "POST", "/v1/cluster/members", Some(&member))?;
                let catching_up = status == 503 && answer["code"] == "member_catching_up";
                if catching_up && std::time::Instant::now() < deadline {
                    eprintln!("{}", answer["detail"].as_str().unwrap_or("catching up"));
                    std::thread::sleep(Duration::from_secs(2));
                    continue;
                }
                if !(200..300).contains(&status) {
                    return Err(problem("POST", "/v1/cluster/members", status, &answer));
                }
                break answer;
            }
        }
        ClusterCommand::Remove { client, id } => {
            let path = format!("/v1/cluster/members/{id}");
            call(&client, "DELETE", &path, None)?
        }
    };
    print_cluster(&status);
    Ok(())
}

/// A cluster's status as a table: one line per member.
fn print_cluster(status: &Value) {
    let leader = status["leader_id"].as_u64();
    println!(
        "member {} sees: leader {}, term {}, committed {}, applied {}",
        status["node_id"],
        leader.map_or("none".to_string(), |l| l.to_string()),
        status["term"],
        status["commit_index"],
        status["applied_index"]
    );
    println!(
        "{:>4}  {:<12} {:<6} {:>10}  {:<28} peer",
        "id", "state", "voter", "matched", "api"
    );
    for member in status["members"].as_array().into_iter().flatten() {
        let matched = member["matched_index"]
            .as_u64()
            .map_or("-".to_string(), |m| m.to_string());
        println!(
            "{:>4}  {:<12} {:<6} {:>10}  {:<28} {}",
            member["id"],
            member["state"].as_str().unwrap_or("?"),
            member["voter"],
            matched,
            member["api"].as_str().unwrap_or("?"),
            member["peer"].as_str().unwrap_or("?")
        );
    }
}

fn send(args: SendArgs) -> anyhow::Result<()> {
    let body = if args.body == "-" {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text)?;
        text
    } else {
        args.body
    };
    let mut request = json!({"topic": args.topic, "body": body});
    match (args.delay, args.deliver_at, args.delay_level) {
        (Some(delay), _, _) => request["delay"] = json!(delay),
        (_, Some(at), _) => request["deliver_at"] = json!(at),
        (_, _, Some(level)) => request["delay_level"] = json!(level),
        _ => request["delay"] = json!(0),
    }
    if let Some(key) = args.key {
        request["key"] = json!(key);
    }
    if let Some(sink) = args.sink {
        request["sink"] = json!(sink);
    }
    request["headers"] = header_map(&args.headers)?;
    let answer = call(&args.client, "POST", "/v1/messages", Some(&request))?;
    println!("{answer}");
    Ok(())
}

/// `--header name=value` arguments as a JSON object.
fn header_map(headers: &[String]) -> anyhow::Result<Value> {
    let mut map = serde_json::Map::new();
    for header in headers {
        let (name, value) = header
            .split_once('=')
            .with_context(|| format!("--header {header:?}: expected name=value"))?;
        map.insert(name.into(), json!(value));
    }
    Ok(Value::Object(map))
}

/// `text` percent-encoded for a URL's path segment or query value: every byte outside A-Z a-z 0-9
/// `-._~`. An id the service refuses is then refused by the service, with its code, and never
/// names another route.
fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn schedule(command: ScheduleCommand) -> anyhow::Result<()> {
    match command {
        ScheduleCommand::Put(args) => schedule_put(*args),
        ScheduleCommand::List {
            client,
            limit,
            json,
        } => {
            let schedules = all_schedules(&client, limit)?;
            if json {
                println!("{}", Value::Array(schedules));
            } else if schedules.is_empty() {
                eprintln!("delayd schedule: no schedules");
            } else {
                print_schedules(&schedules);
            }
            Ok(())
        }
        ScheduleCommand::Pause { client, id } => {
            let path = format!("/v1/schedules/{}/pause", url_encode(&id));
            println!("{}", call(&client, "POST", &path, None)?);
            eprintln!("delayd schedule: paused {id}");
            Ok(())
        }
        ScheduleCommand::Resume { client, id } => {
            let path = format!("/v1/schedules/{}/resume", url_encode(&id));
            let answer = call(&client, "POST", &path, None)?;
            println!("{answer}");
            eprintln!("delayd schedule: resumed {id}; {}", next_firing(&answer));
            Ok(())
        }
        ScheduleCommand::Delete { client, id } => {
            let path = format!("/v1/schedules/{}", url_encode(&id));
            call(&client, "DELETE", &path, None)?;
            eprintln!("delayd schedule: deleted {id}");
            Ok(())
        }
    }
}

fn schedule_put(args: SchedulePutArgs) -> anyhow::Result<()> {
    let mut request = json!({"topic": args.topic, "headers": header_map(&args.headers)?});
    let optional = [
        ("cron", args.cron),
        ("every", args.every),
        ("tz", args.tz),
        ("body", args.body),
        ("body_base64", args.body_base64),
        ("key", args.key),
        ("sink", args.sink),
        ("catchup", args.catchup),
    ];
    for (field, value) in optional {
        if let Some(value) = value {
            request[field] = json!(value);
        }
    }
    if let Some(path) = &args.body_file {
        let bytes = if path.as_os_str() == "-" {
            let mut bytes = Vec::new();
            std::io::stdin().read_to_end(&mut bytes)?;
            bytes
        } else {
            std::fs::read(path).with_context(|| format!("reading {}", path.display()))?
        };
        match String::from_utf8(bytes) {
            Ok(text) => request["body"] = json!(text),
            Err(binary) => {
                let encoded = base64::engine::general_purpose::STANDARD.encode(binary.as_bytes());
                request["body_base64"] = json!(encoded);
            }
        }
    }
    // The API takes a time as RFC 3339 text or as a number of unix milliseconds.
    for (field, value) in [("start_at", args.start_at), ("end_at", args.end_at)] {
        if let Some(value) = value {
            request[field] = match value.parse::<i64>() {
                Ok(ms) => json!(ms),
                Err(_) => json!(value),
            };
        }
    }
    let path = format!("/v1/schedules/{}", url_encode(&args.id));
    let (status, answer) = exchange(&args.client, "PUT", &path, Some(&request))?;
    if !(200..300).contains(&status) {
        return Err(problem("PUT", &path, status, &answer));
    }
    println!("{answer}");
    let done = if status == 201 { "created" } else { "replaced" };
    eprintln!(
        "delayd schedule: {done} {}; {}",
        args.id,
        next_firing(&answer)
    );
    Ok(())
}

/// When a schedule fires next, in words.
fn next_firing(schedule: &Value) -> String {
    match schedule["next_fire_at"].as_str() {
        Some(at) => format!("next firing at {at}"),
        None if schedule["paused"] == json!(true) => "paused: no firing planned".to_string(),
        None => "no firing planned (it has ended)".to_string(),
    }
}

/// Every schedule, following `next_cursor` from page to page.
fn all_schedules(client: &Client, limit: Option<u32>) -> anyhow::Result<Vec<Value>> {
    let mut schedules = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut query = Vec::new();
        if let Some(limit) = limit {
            query.push(format!("limit={limit}"));
        }
        if let Some(cursor) = &cursor {
            query.push(format!("cursor={}", url_encode(cursor)));
        }
        let path = match query.is_empty() {
            true => "/v1/schedules".to_string(),
            false => format!("/v1/schedules?{}", query.join("&")),
        };
        let page = call(client, "GET", &path, None)?;
        schedules.extend(page["schedules"].as_array().into_iter().flatten().cloned());
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => return Ok(schedules),
        }
    }
}

/// Schedules as a table: one line each, the columns as wide as their widest cell.
fn print_schedules(schedules: &[Value]) {
    let text = |value: &Value| value.as_str().unwrap_or("-").to_string();
    let header = [
        "id",
        "schedule",
        "tz",
        "paused",
        "next_fire_at",
        "last_fire_at",
        "fired",
    ]
    .map(String::from);
    let rows: Vec<[String; 7]> = schedules
        .iter()
        .map(|s| {
            let timing = match (s["cron"].as_str(), s["every"].as_str()) {
                (Some(cron), _) => cron.to_string(),
                (None, Some(every)) => format!("every {every}"),
                (None, None) => "-".to_string(),
            };
            [
                text(&s["id"]),
                timing,
                text(&s["tz"]),
                s["paused"].to_string(),
                text(&s["next_fire_at"]),
                text(&s["last_fire_at"]),
                s["fired"].to_string(),
            ]
        })
        .collect();
    let mut widths = [0usize; 7];
    for row in std::iter::once(&header).chain(&rows) {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for row in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        println!("{}", cells.join("  ").trim_end());
    }
}

fn tail(args: TailArgs) -> anyhow::Result<()> {
    let topic = &args.topic;
    // A name no topic can have would be waited for for ever.
    if !delayd::broker::valid_topic(topic) {
        bail!(
            "{topic:?} is not a topic name: 1 to 200 of A-Z a-z 0-9 . _ -, not all dots (or $dead)"
        );
    }
    let from = if args.from_beginning {
        Start::Beginning
    } else {
        args.from
    };
    // Where each queue starts is fixed now, when tail starts, not when it gets to poll the queue: a
    // message delivered meanwhile is printed, not skipped. A topic that does not exist yet has nothing
    // in it: every queue starts at offset 0 (its beginning and its end at this moment), however late
    // tail learns how many queues it has.
    let starts: Vec<u64> = match queue_offsets(&args.client, topic)? {
        Some(queues) => queues
            .iter()
            .map(|&(min, max)| if from == Start::Beginning { min } else { max })
            .collect(),
        None => {
            eprintln!("delayd tail: topic {topic:?} does not exist yet; waiting for it, to print it from its first message");
            loop {
                // On a missing topic this long poll waits for the next delivery to any topic.
                let wait = format!("/v1/topics/{topic}/queues/0/messages?wait_ms=20000");
                let (status, answer) = exchange(&args.client, "GET", &wait, None)?;
                if status != 200 && status != 404 {
                    return Err(problem("GET", &wait, status, &answer));
                }
                if let Some(queues) = queue_offsets(&args.client, topic)? {
                    break vec![0; queues.len()];
                }
            }
        }
    };
    let queues: Vec<u32> = match args.queue {
        Some(q) if (q as usize) < starts.len() => vec![q],
        Some(q) => bail!(
            "topic {topic:?} has {} queues; there is no queue {q}",
            starts.len()
        ),
        None => (0..starts.len() as u32).collect(),
    };
    let committed = match &args.group {
        Some(group) => call(
            &args.client,
            "GET",
            &format!("/v1/groups/{group}/offsets/{topic}"),
            None,
        )?,
        None => json!({"queues": []}),
    };
    // A group's committed offset wins over --from.
    let mut offsets: Vec<u64> = queues
        .iter()
        .map(|q| {
            committed["queues"]
                .as_array()
                .and_then(|qs| qs.iter().find(|e| e["queue"] == json!(q)))
                .and_then(|e| e["offset"].as_u64())
                .unwrap_or(starts[*q as usize])
        })
        .collect();
    let listed: Vec<String> = queues
        .iter()
        .zip(&offsets)
        .map(|(q, o)| format!("{q}:{o}"))
        .collect();
    eprintln!(
        "delayd tail: topic {topic:?}, from queue:offset {}",
        listed.join(" ")
    );
    let mut printed = 0u64;
    loop {
        // With one queue, long-poll it; with several, poll each briefly in turn.
        let wait = if queues.len() == 1 { 20_000 } else { 500 };
        for (i, queue) in queues.iter().enumerate() {
            let path = format!(
                "/v1/topics/{topic}/queues/{queue}/messages?offset={}&max=256&wait_ms={wait}",
                offsets[i]
            );
            let answer = call(&args.client, "GET", &path, None)?;
            let skipped = answer["skipped"].as_u64().unwrap_or(0);
            if skipped > 0 {
                eprintln!(
                    "delayd tail: queue {queue}: {skipped} messages from offset {} were deleted by retention before they were read",
                    offsets[i]
                );
            }
            for message in answer["messages"].as_array().into_iter().flatten() {
                // Offsets count per queue: the queue tells two messages at one offset apart.
                let mut message = message.clone();
                if let Some(fields) = message.as_object_mut() {
                    fields.insert("queue".into(), json!(queue));
                }
                println!("{message}");
                printed += 1;
                if args.count.is_some_and(|c| printed >= c) {
                    offsets[i] = message["offset"].as_u64().unwrap_or(offsets[i]) + 1;
                    commit(&args, *queue, offsets[i])?;
                    return Ok(());
                }
            }
            let next = answer["next_offset"].as_u64().unwrap_or(offsets[i]);
            if next != offsets[i] {
                offsets[i] = next;
                commit(&args, *queue, next)?;
            }
        }
    }
}

fn commit(args: &TailArgs, queue: u32, offset: u64) -> anyhow::Result<()> {
    if let Some(group) = &args.group {
        let path = format!("/v1/groups/{group}/offsets/{}/{queue}", args.topic);
        call(&args.client, "PUT", &path, Some(&json!({"offset": offset})))?;
    }
    Ok(())
}
