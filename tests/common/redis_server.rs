//! A `redis-server` for a test (Debian's package): started on a loopback port with its own directory,
//! durable (`appendfsync always`), killed on drop; with a connection of its own to publish requests
//! (`XADD` to `delayd:in`, as an application would) and read targets (`XREAD`). The Redis sidecar
//! tests drive it as their [`Mq`]; the cluster tests run a Redis source on it.

use super::sidecar::{Got, Mq};
use super::{free_port, now_ms, server_installed};
use redis::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The stream the sink writes to, and the requests name.
pub const TARGET: &str = "orders:out";

/// A `redis-server` for one test, killed on drop; with a connection of its own.
pub struct RedisServer {
    child: Child,
    port: u16,
    dir: PathBuf,
    connection: Option<redis::Connection>,
}

impl RedisServer {
    /// Starts one, or says why not (and fails under CI, where it must exist).
    pub fn start(dir: &Path) -> Option<RedisServer> {
        if !server_installed("redis-server", "apt-get install -y redis-server") {
            return None;
        }
        Some(RedisServer::start_on(free_port(), dir, &[]))
    }

    /// Starts one on `port` with its data in `dir` (again, after a stop), with extra arguments.
    pub fn start_on(port: u16, dir: &Path, extra: &[&str]) -> RedisServer {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--dir"])
            .arg(dir)
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut server = RedisServer {
            child,
            port,
            dir: dir.to_path_buf(),
            connection: None,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ping: redis::RedisResult<String> = server
                .client()
                .get_connection_with_timeout(Duration::from_secs(1))
                .and_then(|mut c| redis::cmd("PING").query(&mut c));
            if ping.is_ok() {
                server.connection = Some(server.connection());
                return server;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not start: {ping:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).unwrap()
    }

    pub fn connection(&self) -> redis::Connection {
        self.client()
            .get_connection_with_timeout(Duration::from_secs(5))
            .unwrap()
    }

    /// Stops it (SIGKILL: what is acknowledged is on disk already) and starts it again on the same port
    /// and directory, with extra arguments.
    pub fn restart_with(&mut self, extra: &[&str]) {
        self.stop();
        *self = RedisServer::start_on(self.port, &self.dir.clone(), extra);
    }

    /// Reads `stream` from its start until `count` entries came or `within` passed.
    pub fn read(&mut self, stream: &str, count: usize, within: Duration) -> Vec<Got> {
        let redis = self.connection.as_mut().unwrap();
        let deadline = Instant::now() + within;
        let mut got = Vec::new();
        let mut last = "0".to_string();
        while got.len() < count && Instant::now() < deadline {
            let answer: Value = redis::cmd("XREAD")
                .arg("COUNT")
                .arg(100)
                .arg("BLOCK")
                .arg(100)
                .arg("STREAMS")
                .arg(stream)
                .arg(&last)
                .query(redis)
                .unwrap();
            let at_ms = now_ms();
            let Value::Array(streams) = answer else {
                continue;
            };
            for stream in streams {
                let Value::Array(pair) = stream else { continue };
                let Some(Value::Array(entries)) = pair.get(1) else {
                    continue;
                };
                for entry in entries {
                    let Value::Array(parts) = entry else { continue };
                    let (Some(Value::BulkString(id)), Some(Value::Array(fields))) =
                        (parts.first(), parts.get(1))
                    else {
                        continue;
                    };
                    last = String::from_utf8(id.clone()).unwrap();
                    let mut headers: BTreeMap<String, String> = fields
                        .chunks(2)
                        .map(|pair| match pair {
                            [Value::BulkString(n), Value::BulkString(v)] => (
                                String::from_utf8(n.clone()).unwrap(),
                                String::from_utf8(v.clone()).unwrap(),
                            ),
                            other => panic!("{other:?}"),
                        })
                        .collect();
                    let body = headers.remove("body").unwrap();
                    got.push(Got {
                        headers,
                        body,
                        at_ms,
                        mq: (),
                    });
                }
            }
        }
        got
    }

    /// Entries of the source stream delivered to delayd's group and not acknowledged. The group must
    /// exist (delayd's source creates it on connecting): XPENDING answers NOGROUP before.
    pub fn pending(&mut self) -> i64 {
        let answer: Value = redis::cmd("XPENDING")
            .arg("delayd:in")
            .arg("delayd")
            .query(self.connection.as_mut().unwrap())
            .unwrap();
        match answer {
            Value::Array(parts) => match parts.first() {
                Some(Value::Int(n)) => *n,
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        }
    }
}

/// Requests are `XADD`ed to `delayd:in`, their headers as fields and then a field `body`.
impl Mq for RedisServer {
    type Own = ();

    fn target(&self) -> String {
        TARGET.into()
    }

    fn publish(&mut self, fields: &[(&str, &str)], body: &str) {
        let mut command = redis::cmd("XADD");
        command.arg("delayd:in").arg("*");
        for (name, value) in fields {
            command.arg(*name).arg(*value);
        }
        command.arg("body").arg(body);
        let _: String = command.query(self.connection.as_mut().unwrap()).unwrap();
    }

    fn read_target(&mut self, count: usize, within: Duration) -> Vec<Got> {
        self.read(TARGET, count, within)
    }

    fn all_acknowledged(&mut self) -> bool {
        self.pending() == 0
    }

    fn stop(&mut self) {
        self.connection = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn restart(&mut self) {
        self.restart_with(&[]);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}
