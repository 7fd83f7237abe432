//! The webhook sink: POSTs each message to the sink's URL, signed as Standard Webhooks do.
//!
//! Request: the body exactly as stored; `webhook-id` (the message id, stable across attempts),
//! `webhook-timestamp` (unix seconds of this attempt), `webhook-signature: v1,<base64 HMAC-SHA256 of
//! "id.timestamp.body">` keyed with the base64 part of the `whsec_…` secret; `delayd-topic`,
//! `delayd-attempt` (0 for the first), `delayd-deliver-at`; the message's own headers except hop-by-hop
//! ones and delayd's own names (a firing's `delayd-schedule` and `delayd-fire-at` do go: `passed_on`
//! in sink/mod.rs); `content-type` from the message's headers, else `application/octet-stream`.
//!
//! Answers: 2xx is delivered; a network error, a timeout, 408, 429 and 5xx are retried (after
//! `Retry-After` when the receiver sends one, else after the sink's backoff; the scheduler caps either by
//! the sink's `backoff_cap`); any other status is dead at once, with the status in the reason. Redirects
//! are not followed: a webhook reaches only the URL the configuration names.
//!
//! The reason quotes the start of an error answer's body, at most [`MAX_DETAIL_BYTES`]: only that much
//! is read (a chunk at a time, so at most one transport chunk past it), never the whole body, which the
//! receiver may make as large as it likes.

use super::{BoxFuture, Delivery, Sink, SinkOutcome};
use crate::setting::{invalid, ConfigError, Millis};
use crate::timestamp::format_ms;
use base64::Engine;
use hmac::{Hmac, Mac};
use schedulelog::Clock;
use sha2::Sha256;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

/// Headers a message may not set on its webhook request.
const RESERVED: [&str; 13] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "content-type",
    "authorization",
];

/// Why a webhook sink could not be built.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("url {0:?}: must be an absolute http:// or https:// URL")]
    Url(String),
    #[error("secret: must be whsec_ followed by base64 (at least 16 bytes once decoded)")]
    Secret,
    #[error("building the HTTP client: {0}")]
    Client(String),
}

/// A `[sinks.NAME]` table of kind `webhook`.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebhookSinkConfig {
    /// Where to POST (http:// or https://); required.
    pub url: Option<String>,
    /// The signing secret, `whsec_<base64>`; required.
    pub secret: Option<String>,
    /// How long one request may take.
    pub timeout: Millis,
    /// A PEM file of extra CA certificates to trust (a private CA), besides the public roots.
    pub ca_file: Option<std::path::PathBuf>,
}

impl Default for WebhookSinkConfig {
    fn default() -> WebhookSinkConfig {
        WebhookSinkConfig {
            url: None,
            secret: None,
            timeout: Millis(Duration::from_secs(10)),
            ca_file: None,
        }
    }
}

impl WebhookSinkConfig {
    /// Refuses what the sink could not be built from (a bad URL or secret, an unreadable CA file),
    /// naming the key; `key`: the table's (`sinks.NAME`).
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if self.url.is_none() || self.secret.is_none() {
            return Err(invalid(key, "a webhook sink needs url and secret"));
        }
        self.build(Arc::new(schedulelog::SystemClock))
            .map(drop)
            .map_err(|e| invalid(key, e.to_string()))
    }

    pub fn build(&self, clock: Arc<dyn Clock>) -> Result<WebhookSink, WebhookError> {
        WebhookSink::new(
            self.url.as_deref().unwrap_or_default(),
            self.secret.as_deref().unwrap_or_default(),
            self.timeout.0,
            self.ca_file.as_deref(),
            clock,
        )
    }
}

#[derive(Debug)]
pub struct WebhookSink {
    url: reqwest::Url,
    secret: Vec<u8>,
    client: reqwest::Client,
    clock: Arc<dyn Clock>,
}

impl WebhookSink {
    /// `ca_file`: PEM certificates to trust in addition to the public roots (for a private CA).
    pub fn new(
        url: &str,
        secret: &str,
        timeout: Duration,
        ca_file: Option<&std::path::Path>,
        clock: Arc<dyn Clock>,
    ) -> Result<WebhookSink, WebhookError> {
        let parsed = reqwest::Url::parse(url).map_err(|_| WebhookError::Url(url.into()))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
            return Err(WebhookError::Url(url.into()));
        }
        let secret = secret
            .strip_prefix("whsec_")
            .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
            .filter(|s| s.len() >= 16)
            .ok_or(WebhookError::Secret)?;
        let mut builder = reqwest::Client::builder();
        if let Some(path) = ca_file {
            let pem = std::fs::read(path)
                .map_err(|e| WebhookError::Client(format!("reading {}: {e}", path.display())))?;
            let certificates = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| WebhookError::Client(format!("{}: {e}", path.display())))?;
            for certificate in certificates {
                builder = builder.add_root_certificate(certificate);
            }
        }
        let client = builder
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("delayd/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| WebhookError::Client(e.to_string()))?;
        Ok(WebhookSink {
            url: parsed,
            secret,
            client,
            clock,
        })
    }

    /// `v1,<base64 HMAC-SHA256 of "id.timestamp.body">`.
    pub fn sign(secret: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        let signature =
            base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
        format!("v1,{signature}")
    }

    async fn deliver_one(&self, delivery: &Delivery) -> SinkOutcome {
        let message = &delivery.message;
        let id = delivery.id.to_string();
        let timestamp = self.clock.now_ms().div_euclid(1000);
        let mut request = self
            .client
            .post(self.url.clone())
            .header("webhook-id", &id)
            .header("webhook-timestamp", timestamp.to_string())
            .header(
                "webhook-signature",
                Self::sign(&self.secret, &id, timestamp, &message.body),
            )
            .header("delayd-topic", &message.topic)
            .header("delayd-attempt", message.attempt.to_string())
            .header("delayd-deliver-at", format_ms(message.deliver_at_ms));
        let mut content_type = "application/octet-stream";
        for (name, value) in &message.headers {
            let lower = name.to_ascii_lowercase();
            if lower == "content-type" {
                content_type = value;
            } else if !RESERVED.contains(&lower.as_str())
                && !lower.starts_with("webhook-")
                && super::passed_on(name)
            {
                request = request.header(name, value);
            }
        }
        let sent = request
            .header("content-type", content_type)
            .body(message.body.clone())
            .send()
            .await;
        match sent {
            Ok(response) => classify(response).await,
            Err(e) => SinkOutcome::Retry {
                after: None,
                reason: if e.is_timeout() {
                    "timed out".into()
                } else {
                    format!("request failed: {}", error_chain(&e))
                },
            },
        }
    }
}

/// Runs futures concurrently on the current task and returns their outputs in order.
async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(value) => *output = Some(value),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

/// Bytes of an error answer's body quoted in the reason.
pub const MAX_DETAIL_BYTES: usize = 200;

/// The start of a body as text: reads chunks until `max` bytes are in (or the body ends, or fails), and
/// cuts at a character boundary at most `max` bytes in.
async fn body_start(response: &mut reqwest::Response, max: usize) -> String {
    let mut start = Vec::new();
    while start.len() < max {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                start.extend_from_slice(&chunk[..chunk.len().min(max - start.len())])
            }
            Ok(None) | Err(_) => break,
        }
    }
    let mut text = String::from_utf8_lossy(&start).into_owned();
    text.truncate(text.floor_char_boundary(max));
    text
}

async fn classify(mut response: reqwest::Response) -> SinkOutcome {
    let status = response.status();
    if status.is_success() {
        return SinkOutcome::Delivered;
    }
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_retry_after);
    // The rest of the body is not read: dropping the response closes the connection.
    let detail = body_start(&mut response, MAX_DETAIL_BYTES).await;
    let reason = format!(
        "HTTP {}{}",
        status.as_u16(),
        if detail.is_empty() {
            String::new()
        } else {
            format!(": {detail}")
        }
    );
    let code = status.as_u16();
    if code == 408 || code == 429 || status.is_server_error() {
        SinkOutcome::Retry {
            after: retry_after,
            reason,
        }
    } else {
        SinkOutcome::Dead { reason }
    }
}

/// `Retry-After` as seconds (`120`) or as an HTTP date (`Wed, 21 Oct 2026 07:28:00 GMT`, relative to the
/// system clock, as the receiver meant it).
fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let format = time::macros::format_description!(
        "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
    );
    let at = time::PrimitiveDateTime::parse(value, &format)
        .ok()?
        .assume_utc();
    let wait = at - time::OffsetDateTime::now_utc();
    Some(Duration::try_from(wait).unwrap_or(Duration::ZERO))
}

/// An error and its causes on one line (reqwest's own message hides the cause, e.g. "connection refused").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

impl Sink for WebhookSink {
    fn deliver<'a>(&'a self, batch: &'a [Delivery]) -> BoxFuture<'a, Vec<SinkOutcome>> {
        // The requests of a batch go out together; the answers come back in batch order.
        Box::pin(join_all(
            batch.iter().map(|d| self.deliver_one(d)).collect(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_the_standard_webhooks_example() {
        // The example from the Standard Webhooks specification.
        let secret = base64::engine::general_purpose::STANDARD
            .decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .unwrap();
        let body = br#"{"test": 2432232314}"#;
        let signature =
            WebhookSink::sign(&secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1_614_265_330, body);
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn retry_after_in_seconds_or_as_an_http_date() {
        assert_eq!(parse_retry_after("120"), Some(Duration::from_secs(120)));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO),
            "in the past: now"
        );
        let soon = time::OffsetDateTime::now_utc() + time::Duration::seconds(90);
        let format = time::macros::format_description!(
            "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
        );
        let wait = parse_retry_after(&soon.format(&format).unwrap()).unwrap();
        assert!(
            wait > Duration::from_secs(85) && wait <= Duration::from_secs(90),
            "{wait:?}"
        );
        assert_eq!(parse_retry_after("soon"), None);
    }

    /// An error answer whose body never ends: the reason quotes its first 200 bytes and the sink answers
    /// at once (reading the whole body, as before, waited for the request timeout and then quoted
    /// nothing).
    #[test]
    fn only_the_quoted_start_of_an_error_body_is_read() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}/hook", listener.local_addr().unwrap());
            let server = tokio::spawn(async move {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut request = vec![0u8; 64 * 1024];
                let _ = socket.read(&mut request).await;
                let head = "HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n\r\n";
                socket.write_all(head.as_bytes()).await.unwrap();
                let chunk = format!("1000\r\n{}\r\n", "é".repeat(2048));
                // Endless: ends only when the client hangs up.
                while socket.write_all(chunk.as_bytes()).await.is_ok() {}
            });
            let clock: Arc<dyn Clock> = Arc::new(schedulelog::SystemClock);
            let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
            let sink =
                WebhookSink::new(&url, secret, Duration::from_secs(60), None, clock).unwrap();
            let first = schedulelog::Location {
                bucket: schedulelog::Bucket::from_start_minute(29_935_260),
                seq: 1,
            };
            let delivery = Delivery {
                id: schedulelog::MessageId::new(first),
                location: first,
                message: schedulelog::Message {
                    seq: 1,
                    deliver_at_ms: 0,
                    created_at_ms: 0,
                    id: schedulelog::MessageId::new(first),
                    attempt: 0,
                    topic: "t".into(),
                    key: None,
                    dedup: false,
                    headers: Vec::new(),
                    sink: "hook".into(),
                    body: b"hello".to_vec(),
                },
                sent_at_ms: 0,
            };
            let outcome =
                tokio::time::timeout(Duration::from_secs(20), sink.deliver_one(&delivery))
                    .await
                    .expect("answered without reading the whole body");
            let SinkOutcome::Retry { reason, .. } = outcome else {
                panic!("{outcome:?}");
            };
            assert_eq!(reason, format!("HTTP 503: {}", "é".repeat(100)));
            server.await.unwrap();
        });
    }

    #[test]
    fn join_all_runs_together_and_keeps_order() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let started = std::time::Instant::now();
        let outputs = runtime.block_on(join_all(
            [300u64, 100, 200]
                .into_iter()
                .map(|ms| async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    ms
                })
                .collect(),
        ));
        assert_eq!(outputs, vec![300, 100, 200]);
        assert!(
            started.elapsed() < Duration::from_millis(550),
            "concurrent, not one after another"
        );
    }

    #[test]
    fn bad_urls_and_secrets_are_refused() {
        let clock: Arc<dyn Clock> = Arc::new(schedulelog::SystemClock);
        let ok_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let second = Duration::from_secs(1);
        assert!(WebhookSink::new("ftp://x/", ok_secret, second, None, clock.clone()).is_err());
        assert!(WebhookSink::new("not a url", ok_secret, second, None, clock.clone()).is_err());
        let no_prefix = "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        assert!(WebhookSink::new(
            "http://127.0.0.1:9/h",
            no_prefix,
            second,
            None,
            clock.clone()
        )
        .is_err());
        assert!(WebhookSink::new(
            "http://127.0.0.1:9/h",
            "whsec_c2hvcnQ=",
            second,
            None,
            clock.clone()
        )
        .is_err());
        let missing = Some(std::path::Path::new("/nonexistent/ca.pem"));
        assert!(WebhookSink::new(
            "https://example.com/hooks",
            ok_secret,
            second,
            missing,
            clock.clone()
        )
        .is_err());
        assert!(
            WebhookSink::new("https://example.com/hooks", ok_secret, second, None, clock).is_ok()
        );
    }
}
