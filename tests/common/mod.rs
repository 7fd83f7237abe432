//! Helpers shared by the integration test binaries: HTTP requests and their answers, time parsing, and
//! guards for the real `delayd` binary ([`spawn`] → [`Process`] for `serve`, also under a low open-file
//! limit with [`spawn_with_ulimit`]; [`spawn_cli`] → [`Background`] for a client command such as `tail`)
//! that kill it when dropped, pass or fail; [`slowloris`] clients for the HTTP edge's tests; the
//! [`sidecar`] tests' harness over the four MQs, and a [`redis_server`] for them and the cluster tests.
//!
//! A test binary at the top of `tests/` includes it with `mod common;`; one in a directory
//! (`tests/it/main.rs`) with `#[path = "../common/mod.rs"] mod common;`.

#![allow(dead_code, reason = "each test binary uses a part of these helpers")]

pub mod redis_server;
pub mod sidecar;
pub mod slowloris;

use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long [`spawn`] waits for the server to be ready: recovery of a large data dir on a busy machine.
pub const READY_WITHIN: Duration = Duration::from_secs(60);

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The number in the environment variable `name` (a soak's setting), or `default` where it is not
/// set.
pub fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name}={v:?}")))
        .unwrap_or(default)
}

/// xorshift64: reproducible draws from a seed, for the soaks' loads.
pub struct Draws(u64);

impl Draws {
    pub fn new(seed: u64) -> Draws {
        // xorshift never leaves 0.
        Draws(seed | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A draw in `low..high`.
    pub fn between(&mut self, (low, high): (u64, u64)) -> u64 {
        low + self.next() % (high - low)
    }
}

/// An RFC 3339 time from an answer, as unix milliseconds.
pub fn parse(value: &Value) -> i64 {
    let text = value.as_str().unwrap();
    let parsed =
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).unwrap();
    (parsed.unix_timestamp_nanos() / 1_000_000) as i64
}

/// Polls `condition` every 20 ms until it holds; panics naming `what` after `within`.
pub fn wait_for(what: &str, within: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every message the broker holds in `topic`, queue after queue, each read to its end (none for a
/// topic it does not have); a 503 (a cluster without a leader yet) is asked again, for at most a minute.
pub fn topic_messages(base: &str, topic: &str) -> Vec<Value> {
    let answered = |path: &str| {
        let mut answer = None;
        wait_for("an answer other than 503", Duration::from_secs(60), || {
            let got = request(base, "GET", path, None, None);
            let done = got.status != 503;
            answer = Some(got);
            done
        });
        answer.expect("asked at least once")
    };
    let info = answered(&format!("/v1/topics/{topic}"));
    if info.status == 404 {
        return Vec::new();
    }
    assert_eq!(info.status, 200, "{}", info.json);
    let mut all = Vec::new();
    for queue in info.json["queues"].as_array().unwrap() {
        let queue = queue["queue"].as_u64().unwrap();
        let mut offset = 0;
        loop {
            let path =
                format!("/v1/topics/{topic}/queues/{queue}/messages?offset={offset}&max=1000");
            let page = answered(&path);
            assert_eq!(page.status, 200, "{}", page.json);
            let messages = page.json["messages"].as_array().unwrap();
            let next = page.json["next_offset"].as_u64().unwrap();
            let done = messages.is_empty() || next == offset;
            all.extend(messages.iter().cloned());
            if done {
                break;
            }
            offset = next;
        }
    }
    all
}

/// Asserts that the broker's `$dead` topic holds one dead letter per code in `codes` (waiting for them:
/// the scheduler makes a source's dead letter dead a moment after it is stored), each with `body` and a
/// `delayd-dead-reason` starting with its code, and that each is a dead message as any other: found by
/// its id with that reason, and in `GET /v1/messages?status=dead` (the MQ sources' dead letters).
pub fn assert_dead_letters(base: &str, body: &str, codes: &[&str]) {
    let pull = || {
        let mut letters = Vec::new();
        let topic = request(base, "GET", "/v1/topics/$dead", None, None);
        let queues = topic.json["queues"].as_array().map_or(0, Vec::len);
        for queue in 0..queues {
            let path = format!("/v1/topics/$dead/queues/{queue}/messages?offset=0&max=100");
            let pulled = request(base, "GET", &path, None, None);
            letters.extend(pulled.json["messages"].as_array().unwrap().iter().cloned());
        }
        letters
    };
    wait_for("the dead letters", Duration::from_secs(30), || {
        pull().len() >= codes.len()
    });
    let letters = pull();
    assert_eq!(letters.len(), codes.len(), "{letters:?}");
    let listed = request(
        base,
        "GET",
        "/v1/messages?status=dead&limit=1000",
        None,
        None,
    );
    let listed: Vec<&str> = listed.json["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    let mut reasons = Vec::new();
    for letter in &letters {
        assert_eq!(letter["body"], body);
        let reason = letter["headers"]["delayd-dead-reason"].as_str().unwrap();
        let id = letter["id"].as_str().unwrap();
        let status = get_message(base, id);
        assert_eq!(status.json["status"], "dead", "{}", status.json);
        assert_eq!(status.json["reason"], reason, "{}", status.json);
        assert!(listed.contains(&id), "{id} listed as dead");
        reasons.push(reason.to_string());
    }
    for code in codes {
        assert!(
            reasons.iter().any(|r| r.starts_with(code)),
            "{code} in {reasons:?}"
        );
    }
}

/// A loopback port free at the time of asking, for a server a test starts.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether an external server the tests need (`program`, installed by the command `install`) is
/// installed; says why a test is skipped when not, and fails under `CI=true`, where it must be.
pub fn server_installed(program: &str, install: &str) -> bool {
    let found = if program.starts_with('/') {
        Path::new(program).exists()
    } else {
        Command::new(program).arg("--version").output().is_ok()
    };
    if !found {
        let why = format!("{program} is not installed ({install})");
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{why}");
        println!("skipped: {why}");
    }
    found
}

/// An HTTP client that returns non-2xx answers instead of failing on them.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .build()
        .into()
}

/// An HTTP answer: status, content type and JSON body (Null when the body is not JSON).
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub json: Value,
}

impl Answer {
    /// Asserts that this is the problem `code` with the HTTP `status`.
    pub fn assert_problem(&self, status: u16, code: &str) {
        assert_eq!(
            (self.status, self.json["code"].as_str()),
            (status, Some(code)),
            "{}",
            self.json
        );
    }
}

/// One request on a fresh connection (60 s at most); panics on a transport error.
pub fn request(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    token: Option<&str>,
) -> Answer {
    let url = format!("{base}{path}");
    let agent = agent(Duration::from_secs(60));
    let mut response = match method {
        "GET" | "DELETE" => {
            let mut r = if method == "GET" {
                agent.get(&url)
            } else {
                agent.delete(&url)
            };
            if let Some(t) = token {
                r = r.header("Authorization", &format!("Bearer {t}"));
            }
            r.call().unwrap()
        }
        _ => {
            let mut r = match method {
                "PUT" => agent.put(&url),
                "PATCH" => agent.patch(&url),
                _ => agent.post(&url),
            };
            if let Some(t) = token {
                r = r.header("Authorization", &format!("Bearer {t}"));
            }
            r.header("Content-Type", "application/json")
                .send(body.unwrap_or(""))
                .unwrap()
        }
    };
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = response.body_mut().read_to_string().unwrap_or_default();
    Answer {
        status,
        content_type,
        json: serde_json::from_str(&text).unwrap_or(Value::Null),
    }
}

/// Writes `text` to the file `name` in `dir` (a config file, say); its path.
pub fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// The message `id` as `GET /v1/messages/{id}` shows it.
pub fn get_message(base: &str, id: &str) -> Answer {
    request(base, "GET", &format!("/v1/messages/{id}"), None, None)
}

/// `GET /v1/messages/{id}` once its attempt has an outcome: a sink's target (an MQ, the broker) may
/// show a message a moment before delayd has recorded the delivery, which a test may see first.
pub fn settled_message(base: &str, id: &str) -> Answer {
    let mut status = get_message(base, id);
    wait_for("the delivery recorded", Duration::from_secs(10), || {
        status = get_message(base, id);
        status.json["status"] != "scheduled"
    });
    status
}

/// The series of a Prometheus text exposition (`GET /metrics`) and their values, e.g.
/// `delayd_messages_received_total{sink="broker"}` → 0.
/// Asserts that every arrival `(body, arrived at, unix ms)` came no earlier than its body's due time
/// in `due`, and prints the lateness p50 and max, `what` saying how it was measured.
pub fn assert_none_early<'a>(
    arrivals: impl IntoIterator<Item = (&'a str, i64)>,
    due: &std::collections::BTreeMap<String, i64>,
    what: &str,
) {
    let mut lateness: Vec<i64> = arrivals
        .into_iter()
        .map(|(body, at_ms)| {
            let due_ms = due[body];
            assert!(
                at_ms >= due_ms,
                "{body} arrived {} ms early",
                due_ms - at_ms
            );
            at_ms - due_ms
        })
        .collect();
    assert!(!lateness.is_empty(), "nothing arrived");
    lateness.sort();
    println!(
        "lateness over {} arrivals (ms, {what}): p50 {}, max {}",
        lateness.len(),
        lateness[lateness.len() / 2],
        lateness[lateness.len() - 1]
    );
}

pub fn scrape(base: &str) -> std::collections::BTreeMap<String, f64> {
    let mut response = agent(Duration::from_secs(60))
        .get(&format!("{base}/metrics"))
        .call()
        .unwrap();
    assert_eq!(response.status(), 200);
    let text = response.body_mut().read_to_string().unwrap();
    text.lines()
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').unwrap();
            (series.to_string(), value.parse().unwrap())
        })
        .collect()
}

/// Lines of a child's output, read by a thread of their own so a test can wait for one with a deadline.
/// Every line is also appended to a file, for the post-mortem.
#[derive(Debug)]
pub struct Lines {
    received: mpsc::Receiver<String>,
}

impl Lines {
    fn follow(output: impl std::io::Read + Send + 'static, copy_to: &Path) -> Lines {
        let (send, received) = mpsc::channel();
        let mut copy = std::fs::File::create(copy_to).unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(output).lines() {
                let Ok(line) = line else { return };
                let _ = writeln!(copy, "{line}");
                // The reader may be gone (the test no longer listens); keep draining the pipe so the
                // child never blocks on a full one.
                let _ = send.send(line);
            }
        });
        Lines { received }
    }

    /// The next line, or None when the output ended or `deadline` passed first.
    pub fn next_before(&self, deadline: Instant) -> Option<String> {
        let left = deadline.saturating_duration_since(Instant::now());
        self.received.recv_timeout(left).ok()
    }
}

/// The last `count` lines of a file (empty when it cannot be read).
fn tail_of(path: &Path, count: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(count)..].join("\n")
}

/// A `Command` for the binary under test, without the caller's `DELAYD_*` settings (a test names every
/// setting it relies on).
fn delayd() -> Command {
    scrubbed(Command::new(env!("CARGO_BIN_EXE_delayd")))
}

fn scrubbed(mut command: Command) -> Command {
    for (name, _) in std::env::vars() {
        if name.starts_with("DELAYD_") {
            command.env_remove(name);
        }
    }
    command
}

/// [`delayd`] started through `sh -c 'ulimit ULIMIT && exec delayd "$@"'`, e.g. with `-n 256` (soft and
/// hard open-file limits) or `-S -n 200` (the soft one only). `exec` keeps the pid, so the guards
/// still kill delayd itself.
fn delayd_with_ulimit(ulimit: &str) -> Command {
    let mut command = scrubbed(Command::new("sh"));
    command
        .arg("-c")
        .arg(format!("ulimit {ulimit} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_delayd"));
    command
}

/// The real `delayd serve`, ready to answer (recovery done), on a loopback port it picked. Dropping it
/// sends SIGKILL and waits for the exit, whether the test passed or failed.
#[derive(Debug)]
pub struct Process {
    /// `http://127.0.0.1:PORT`
    pub base: String,
    child: Child,
    /// The child's stdout (the address line, then its log: tracing writes to stdout) and stderr.
    logs: tempfile::TempDir,
    stdout: Lines,
    /// The output was already shown in a failed start's panic message.
    reported: bool,
}

/// Starts `delayd serve --listen 127.0.0.1:0 --data-dir DATA_DIR EXTRA_ARGS...` and returns once it is
/// ready: after the "delayd listening on" line (printed right after `bind`, before recovery) it polls
/// `GET /readyz`, which is answered only once recovery is done and the router serves. Fails with the
/// tail of the child's output if it exits first or is not ready within [`READY_WITHIN`].
///
/// The free-space reserve (`limits.min_free_disk_bytes`) is off: how full the test machine's disk is must
/// not decide a test that is not about it. [`spawn_with_env`] sets it (or anything else) otherwise.
pub fn spawn(data_dir: &Path, extra_args: &[&str]) -> Process {
    spawn_with_env(data_dir, extra_args, &[("DELAYD_MIN_FREE_DISK_BYTES", "0")])
}

/// [`spawn`] with the given `DELAYD_*` environment instead of the default one (`RUST_LOG` is `warn`
/// unless `env` sets it).
pub fn spawn_with_env(data_dir: &Path, extra_args: &[&str], env: &[(&str, &str)]) -> Process {
    start(delayd(), data_dir, extra_args, env)
}

/// [`spawn_with_env`] under an open-file limit: `ulimit` takes the arguments of the shell's `ulimit`,
/// e.g. `-n 256` (soft and hard) or `-S -n 200` (soft only).
pub fn spawn_with_ulimit(
    data_dir: &Path,
    extra_args: &[&str],
    env: &[(&str, &str)],
    ulimit: &str,
) -> Process {
    start(delayd_with_ulimit(ulimit), data_dir, extra_args, env)
}

/// Runs `delayd serve --data-dir DATA_DIR EXTRA_ARGS...` under `ulimit` (as [`spawn_with_ulimit`];
/// `""` for none) expecting it to exit by itself within `within`: its exit status (None: it was still
/// running, and is killed) and its stderr.
pub fn serve_until_exit(
    data_dir: &Path,
    extra_args: &[&str],
    env: &[(&str, &str)],
    ulimit: &str,
    within: Duration,
) -> (Option<ExitStatus>, String) {
    let logs = tempfile::tempdir().unwrap();
    let stderr_path = logs.path().join("stderr.log");
    let mut command = match ulimit {
        "" => delayd(),
        ulimit => delayd_with_ulimit(ulimit),
    };
    let mut child = command
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .args(extra_args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status,
        std::fs::read_to_string(&stderr_path).unwrap_or_default(),
    )
}

fn start(command: Command, data_dir: &Path, extra_args: &[&str], env: &[(&str, &str)]) -> Process {
    let deadline = Instant::now() + READY_WITHIN;
    let mut args = vec!["--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra_args);
    let mut process = launch(command, data_dir, &args, env, deadline);
    process.wait_ready(deadline);
    process
}

/// A cluster member: `delayd serve --config CONFIG --data-dir DATA_DIR` (the config names its listen
/// address, which the other members forward to), returned once it printed its address line, before
/// it is ready (a member is ready only once a majority is up: start them all, then
/// [`Process::wait_ready_within`]).
pub fn spawn_member(config: &Path, data_dir: &Path, env: &[(&str, &str)]) -> Process {
    let config = config.to_str().unwrap();
    let deadline = Instant::now() + READY_WITHIN;
    launch(delayd(), data_dir, &["--config", config], env, deadline)
}

/// Starts `delayd serve --data-dir DATA_DIR ARGS...` and reads its address line.
fn launch(
    mut command: Command,
    data_dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    deadline: Instant,
) -> Process {
    let mut logs = tempfile::tempdir().unwrap();
    // For a post-mortem of a flaky run: the children's output is kept (its dir is printed).
    if std::env::var_os("DELAYD_TEST_KEEP_LOGS").is_some() {
        logs.disable_cleanup(true);
        eprintln!("delayd serve's output goes to {}", logs.path().display());
    }
    let stderr = std::fs::File::create(logs.path().join("stderr.log")).unwrap();
    let mut child = command
        .args(["serve", "--data-dir"])
        .arg(data_dir)
        .args(args)
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let stdout = Lines::follow(
        child.stdout.take().unwrap(),
        &logs.path().join("stdout.log"),
    );
    // From here on the guard owns the child: a failed start below still kills it.
    let mut process = Process {
        base: String::new(),
        child,
        logs,
        stdout,
        reported: false,
    };
    let Some(line) = process.stdout.next_before(deadline) else {
        process.fail("printed no address line");
    };
    let Some(address) = line.trim().strip_prefix("delayd listening on ") else {
        process.fail(&format!("printed {line:?} instead of its address"));
    };
    process.base = address.to_string();
    process
}

impl Process {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// [`Process::wait_ready`] within `within` from now.
    pub fn wait_ready_within(&mut self, within: Duration) {
        self.wait_ready(Instant::now() + within);
    }

    /// Polls `/readyz` until 200. During recovery the connection waits in the listen backlog, so each
    /// attempt has a short timeout of its own and the child is checked between attempts.
    fn wait_ready(&mut self, deadline: Instant) {
        let url = format!("{}/readyz", self.base);
        let mut last = String::from("no answer yet");
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.fail(&format!("exited ({status}) before it was ready"));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = left
                .min(Duration::from_secs(2))
                .max(Duration::from_millis(1));
            match agent(attempt).get(&url).call() {
                Ok(response) if response.status() == 200 => return,
                Ok(mut response) => {
                    let body = response.body_mut().read_to_string().unwrap_or_default();
                    last = format!("/readyz answered {}: {body}", response.status());
                }
                Err(error) => last = format!("/readyz: {error}"),
            }
            // Not answered with 200 (a refused or timed-out connection): a brief pause before the next
            // attempt, on a fresh connection.
            std::thread::sleep(Duration::from_millis(20));
        }
        self.fail(&format!("was not ready within {READY_WITHIN:?} ({last})"));
    }

    fn fail(&mut self, what: &str) -> ! {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reported = true;
        panic!(
            "delayd serve (pid {}) {what}; the end of its output:\n{}",
            self.child.id(),
            self.output_tail(30)
        );
    }

    /// The next line of the child's stdout after those read so far (the address line is read by the
    /// spawn), or None when the output ended or `deadline` passed first.
    pub fn next_line_before(&self, deadline: Instant) -> Option<String> {
        self.stdout.next_before(deadline)
    }

    /// Everything the child has written to stdout so far (its log, after the address line).
    pub fn stdout_so_far(&self) -> String {
        std::fs::read_to_string(self.logs.path().join("stdout.log")).unwrap_or_default()
    }

    /// The last `lines` lines of the child's stderr and stdout.
    pub fn output_tail(&self, lines: usize) -> String {
        format!(
            "--- stderr\n{}\n--- stdout\n{}",
            tail_of(&self.logs.path().join("stderr.log"), lines),
            tail_of(&self.logs.path().join("stdout.log"), lines)
        )
    }

    /// SIGKILL, then wait for the exit. Repeatable.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM (a graceful stop), then wait for the exit.
    pub fn terminate(&mut self) -> ExitStatus {
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -TERM {}", self.child.id());
        self.child.wait().unwrap()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() && !self.reported {
            eprintln!(
                "delayd serve at {} (pid {}), the end of its output:\n{}",
                self.base,
                self.child.id(),
                self.output_tail(20)
            );
        }
    }
}

/// A `delayd` client command running in the background (e.g. `tail`), with its output readable line by
/// line. Dropping it sends SIGKILL and waits, pass or fail.
#[derive(Debug)]
pub struct Background {
    child: Child,
    pub stdout: Lines,
    pub stderr: Lines,
    _logs: tempfile::TempDir,
}

/// Starts `delayd ARGS...` against the server at `base` (`DELAYD_URL`).
pub fn spawn_cli(base: &str, args: &[&str]) -> Background {
    let logs = tempfile::tempdir().unwrap();
    let mut child = delayd()
        .args(args)
        .env("DELAYD_URL", base)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = Lines::follow(
        child.stdout.take().unwrap(),
        &logs.path().join("stdout.log"),
    );
    let stderr = Lines::follow(
        child.stderr.take().unwrap(),
        &logs.path().join("stderr.log"),
    );
    Background {
        child,
        stdout,
        stderr,
        _logs: logs,
    }
}

impl Background {
    /// Reads the rest of its stdout until it closes (the command exited), at most until `deadline`, and
    /// returns those lines with the exit status; the status is None when it was still running at the
    /// deadline (it is then killed).
    pub fn finish_before(&mut self, deadline: Instant) -> (Vec<String>, Option<ExitStatus>) {
        let mut rest = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.received.recv_timeout(left) {
                Ok(line) => rest.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return (rest, None);
                }
            }
        }
        // Its stdout is closed: it has exited or is exiting.
        (rest, Some(self.child.wait().unwrap()))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
