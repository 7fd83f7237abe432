//! Webhook sinks against a real HTTP receiver on a loopback port. The receiver verifies every signature
//! with the Standard Webhooks algorithm, answers from a script per message body, and records when each
//! attempt arrived; the tests measure retry gaps, rate limits and lateness from those records.

use super::*;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use base64::Engine;
use delayd::sink::webhook::WebhookSinkConfig;
use delayd::sink::LaneConfig;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

#[derive(Debug, Clone)]
pub(super) struct Hit {
    pub(super) body: Vec<u8>,
    pub(super) id: String,
    pub(super) attempt: u16,
    pub(super) headers: HeaderMap,
    pub(super) at: Instant,
    pub(super) at_ms: i64,
}

#[derive(Clone, Default)]
struct Receiver {
    script: Arc<Mutex<HashMap<String, Vec<&'static str>>>>,
    hits: Arc<Mutex<Vec<Hit>>>,
    /// Signalled on every hit, so tests wait for arrivals instead of polling.
    arrived: Arc<std::sync::Condvar>,
    bad_signatures: Arc<Mutex<u32>>,
    /// Requests answered `hold` wait here until notified, then answer 204.
    release: Arc<tokio::sync::Notify>,
}

/// A receiver listening on a port of its own, until the test ends.
pub(super) struct Endpoint {
    pub(super) url: String,
    receiver: Receiver,
    _runtime: tokio::runtime::Runtime,
}

fn verify(headers: &HeaderMap, body: &[u8]) -> bool {
    let get = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let key = base64::engine::general_purpose::STANDARD
        .decode(SECRET.trim_start_matches("whsec_"))
        .unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{}.{}.", get("webhook-id"), get("webhook-timestamp")).as_bytes());
    mac.update(body);
    let expected = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    // The header may carry several space-separated signatures; one valid v1 is enough.
    get("webhook-signature")
        .split(' ')
        .any(|s| s == format!("v1,{expected}"))
}

async fn receive(
    State(receiver): State<Receiver>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    if !verify(&headers, &body) {
        *receiver.bad_signatures.lock().unwrap() += 1;
    }
    let text = String::from_utf8_lossy(&body).to_string();
    let attempt = headers
        .get("delayd-attempt")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(u16::MAX);
    receiver.hits.lock().unwrap().push(Hit {
        body: body.to_vec(),
        id: headers
            .get("webhook-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string(),
        attempt,
        headers: headers.clone(),
        at: Instant::now(),
        at_ms: now_ms(),
    });
    receiver.arrived.notify_all();
    let answer = {
        let mut script = receiver.script.lock().unwrap();
        match script.get_mut(&text) {
            Some(answers) if !answers.is_empty() => answers.remove(0),
            _ => "ok",
        }
    };
    match answer.split_once(':') {
        Some(("429", secs)) => (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", secs.to_string())],
            "slow down",
        )
            .into_response(),
        Some(("sleep", ms)) => {
            tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
            StatusCode::OK.into_response()
        }
        _ => match answer {
            "hold" => {
                receiver.release.notified().await;
                StatusCode::NO_CONTENT.into_response()
            }
            "503" => (StatusCode::SERVICE_UNAVAILABLE, "try later").into_response(),
            "400" => (StatusCode::BAD_REQUEST, "bad payload").into_response(),
            "302" => (
                StatusCode::FOUND,
                [("location", "http://127.0.0.1:9/elsewhere")],
            )
                .into_response(),
            _ => StatusCode::NO_CONTENT.into_response(),
        },
    }
}

pub(super) fn endpoint(script: &[(&str, Vec<&'static str>)]) -> Endpoint {
    let receiver = Receiver::default();
    receiver.script.lock().unwrap().extend(
        script
            .iter()
            .map(|(body, answers)| (body.to_string(), answers.clone())),
    );
    let (runtime, listener) = runtime_and_listener(1);
    let url = format!("http://{}/hooks", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route("/hooks", axum::routing::post(receive))
        .with_state(receiver.clone());
    runtime.spawn(async move { axum::serve(listener, app).await });
    Endpoint {
        url,
        receiver,
        _runtime: runtime,
    }
}

/// A webhook sink to `url`, one message per call; `edit` changes its lane and its webhook keys.
pub(super) fn webhook_sink(
    url: &str,
    edit: impl FnOnce(&mut LaneConfig, &mut WebhookSinkConfig),
) -> delayd::config::SinkConfig {
    let mut lane = LaneConfig {
        max_batch: Some(1),
        ..LaneConfig::default()
    };
    let mut webhook = WebhookSinkConfig {
        url: Some(url.into()),
        secret: Some(SECRET.into()),
        ..WebhookSinkConfig::default()
    };
    edit(&mut lane, &mut webhook);
    delayd::config::SinkConfig {
        lane,
        kind: delayd::config::SinkKind::Webhook(webhook),
    }
}

impl Endpoint {
    pub(super) fn hits(&self) -> Vec<Hit> {
        self.receiver.hits.lock().unwrap().clone()
    }

    /// Waits until the receiver has `count` hits that match, woken by each arrival (30 s at most).
    pub(super) fn wait_until(&self, count: usize, matches: impl Fn(&Hit) -> bool) -> Vec<Hit> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut hits = self.receiver.hits.lock().unwrap();
        loop {
            let matching: Vec<Hit> = hits.iter().filter(|h| matches(h)).cloned().collect();
            let left = deadline.saturating_duration_since(Instant::now());
            if matching.len() >= count || left.is_zero() {
                return matching;
            }
            hits = self.receiver.arrived.wait_timeout(hits, left).unwrap().0;
        }
    }

    fn hits_for(&self, body: &str) -> Vec<Hit> {
        self.hits()
            .into_iter()
            .filter(|h| h.body == body.as_bytes())
            .collect()
    }

    /// Waits until `count` requests for `body` arrived.
    pub(super) fn wait_for(&self, body: &str, count: usize) -> Vec<Hit> {
        self.wait_until(count, |h| h.body == body.as_bytes())
    }
}

fn post_batch(server: &Server, messages: Vec<Value>) {
    let answer = server.call(
        "POST",
        "/v1/messages/batch",
        Some(json!({"messages": messages})),
    );
    assert_eq!(answer.status, 200, "{}", answer.json);
}

/// Polls the status API (it has no change notification) until the message reaches `status`.
fn settled_status(server: &Server, id: &str, status: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answer = server.call("GET", &format!("/v1/messages/{id}"), None);
        if answer.json["status"] == status || Instant::now() > deadline {
            return answer.json;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn schedule(server: &Server, sink: &str, body: Value) -> String {
    let mut request = json!({"topic": "hooks.test", "delay": 0, "sink": sink});
    for (k, v) in body.as_object().unwrap() {
        request[k] = v.clone();
    }
    let answer = server.call("POST", "/v1/messages", Some(request));
    assert_eq!(answer.status, 201, "{}", answer.json);
    answer.json["id"].as_str().unwrap().to_string()
}

#[test]
fn webhook_requests_are_signed_and_carry_the_message() {
    let hook = endpoint(&[]);
    let server = Server::start(|c| {
        c.sinks
            .insert("billing".into(), webhook_sink(&hook.url, |_, _| {}));
    });
    let id = schedule(
        &server,
        "billing",
        json!({"body_base64": "AAECA/8=", "headers": {"x-trace": "abc", "connection": "close", "content-type": "application/x-raw", "webhook-id": "forged"}}),
    );
    let hit = hook
        .wait_until(1, |_| true)
        .pop()
        .expect("the webhook was called");
    assert_eq!(
        hit.body,
        vec![0, 1, 2, 3, 255],
        "the body exactly as stored"
    );
    assert_eq!(
        *hook.receiver.bad_signatures.lock().unwrap(),
        0,
        "the signature verifies"
    );
    assert_eq!(
        hit.id, id,
        "webhook-id is the message id, not the message's own header"
    );
    assert_eq!(hit.attempt, 0);
    let header = |name: &str| {
        hit.headers
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    };
    assert_eq!(header("delayd-topic").as_deref(), Some("hooks.test"));
    assert!(header("delayd-deliver-at").is_some_and(|v| v.ends_with('Z')));
    assert_eq!(header("x-trace").as_deref(), Some("abc"));
    assert_eq!(header("content-type").as_deref(), Some("application/x-raw"));
    assert_ne!(
        header("connection").as_deref(),
        Some("close"),
        "hop-by-hop headers are not forwarded"
    );
    let timestamp: i64 = header("webhook-timestamp").unwrap().parse().unwrap();
    assert!((timestamp - hit.at_ms / 1000).abs() <= 1);
    assert_eq!(
        settled_status(&server, &id, "delivered")["status"],
        "delivered"
    );
}

/// `DELETE` while the receiver holds the request: 409 `delivery_in_flight` (it may still be delivered, so
/// a 200 would be a lie), nothing written; once it is answered, 409 `already_delivered`.
#[test]
fn a_cancel_during_a_webhook_call_answers_delivery_in_flight() {
    let hook = endpoint(&[("held", vec!["hold"])]);
    let server = Server::start(|c| {
        c.sinks
            .insert("billing".into(), webhook_sink(&hook.url, |_, _| {}));
    });
    let id = schedule(&server, "billing", json!({"body": "held"}));
    hook.wait_for("held", 1);
    let answer = server.call("DELETE", &format!("/v1/messages/{id}"), None);
    assert_eq!(answer.status, 409, "{}", answer.json);
    assert_eq!(answer.json["code"], "delivery_in_flight");
    let status = server.call("GET", &format!("/v1/messages/{id}"), None);
    assert_eq!(status.json["status"], "scheduled", "nothing was cancelled");
    hook.receiver.release.notify_one();
    settled_status(&server, &id, "delivered");
    let answer = server.call("DELETE", &format!("/v1/messages/{id}"), None);
    assert_eq!(answer.status, 409, "{}", answer.json);
    assert_eq!(answer.json["code"], "already_delivered");
}

#[test]
fn retries_follow_the_backoff_and_retry_after_then_dead_letters() {
    let hook = endpoint(&[
        ("flaky", vec!["503", "503", "ok"]),
        ("told", vec!["429:1", "ok"]),
        ("bad", vec!["400"]),
        ("doomed", vec!["503", "503", "503", "503"]),
        ("slow", vec!["sleep:1500", "ok"]),
        ("moved", vec!["302"]),
    ]);
    let server = Server::start(|c| {
        let sink = webhook_sink(&hook.url, |s, w| {
            s.backoff_initial = delayd::config::Millis(Duration::from_millis(200));
            s.backoff_multiplier = 2.0;
            s.max_attempts = 4;
            w.timeout = delayd::config::Millis(Duration::from_millis(500));
            s.max_in_flight = 8;
        });
        c.sinks.insert("hooks".into(), sink);
    });
    let ids: HashMap<&str, String> = ["flaky", "told", "bad", "doomed", "slow", "moved"]
        .into_iter()
        .map(|body| (body, schedule(&server, "hooks", json!({"body": body}))))
        .collect();

    let gaps = |hits: &[Hit]| -> Vec<u128> {
        hits.windows(2)
            .map(|w| (w[1].at - w[0].at).as_millis())
            .collect()
    };
    // 503, 503, then delivered; waits of 200 ms and 400 ms, each jittered down to half.
    let flaky = hook.wait_for("flaky", 3);
    assert_eq!(
        flaky.iter().map(|h| h.attempt).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    let g = gaps(&flaky);
    println!("flaky: gaps {g:?} ms (backoff 200 then 400, jitter 50–100%)");
    assert!(
        (100..1_000).contains(&g[0]) && (200..1_200).contains(&g[1]),
        "{g:?}"
    );
    // 429 with Retry-After: 1 waits the second it was told.
    let told = hook.wait_for("told", 2);
    let g = gaps(&told);
    println!("told: gap {g:?} ms (Retry-After: 1)");
    assert!((1_000..3_000).contains(&g[0]), "{g:?}");
    // A timeout is retried.
    let slow = hook.wait_for("slow", 2);
    assert_eq!(
        slow.iter().map(|h| h.attempt).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert_eq!(
        settled_status(&server, &ids["slow"], "delivered")["attempts"],
        2
    );
    // 400 is dead at once; 503 four times is dead after the last attempt.
    let bad = settled_status(&server, &ids["bad"], "dead");
    assert_eq!(bad["status"], "dead");
    assert!(
        bad["reason"].as_str().unwrap().starts_with("HTTP 400"),
        "{bad}"
    );
    assert_eq!(hook.hits_for("bad").len(), 1);
    let doomed = settled_status(&server, &ids["doomed"], "dead");
    assert_eq!(
        doomed["reason"],
        "gave up after 4 attempts: HTTP 503: try later"
    );
    assert_eq!(hook.hits_for("doomed").len(), 4);
    assert_eq!(
        settled_status(&server, &ids["flaky"], "delivered")["attempts"],
        3
    );
    // A redirect is not followed: a webhook reaches only the URL its configuration names.
    let moved = settled_status(&server, &ids["moved"], "dead");
    assert!(
        moved["reason"].as_str().unwrap().starts_with("HTTP 302"),
        "{moved}"
    );
    assert_eq!(hook.hits_for("moved").len(), 1);
    // Dead messages land in the broker topic $dead with why.
    let letters = server.call(
        "GET",
        "/v1/topics/$dead/queues/0/messages?offset=0&max=10&wait_ms=5000",
        None,
    );
    let letters = letters.json["messages"].as_array().unwrap().clone();
    let bodies: Vec<&str> = letters
        .iter()
        .map(|m| m["body"].as_str().unwrap())
        .collect();
    assert!(bodies.contains(&"bad"), "{letters:?}");
    let bad_letter = letters.iter().find(|m| m["body"] == "bad").unwrap();
    assert!(bad_letter["headers"]["delayd-dead-reason"]
        .as_str()
        .unwrap()
        .starts_with("HTTP 400"));
    assert_eq!(bad_letter["headers"]["delayd-original-topic"], "hooks.test");
    assert_eq!(bad_letter["id"], json!(ids["bad"]));
    assert_eq!(*hook.receiver.bad_signatures.lock().unwrap(), 0);
}

#[test]
fn the_rate_limit_holds_by_measurement() {
    let hook = endpoint(&[]);
    let server = Server::start(|c| {
        let sink = webhook_sink(&hook.url, |s, _| {
            s.rate_per_sec = Some(20.0);
            s.burst = 1;
            s.max_in_flight = 8;
        });
        c.sinks.insert("paced".into(), sink);
    });
    let at = now_ms() + 300;
    let messages: Vec<Value> = (0..30)
        .map(|i| json!({"topic": "t", "body": format!("p{i}"), "deliver_at": at, "sink": "paced"}))
        .collect();
    post_batch(&server, messages);
    let hits = hook.wait_until(30, |_| true);
    assert_eq!(hits.len(), 30);
    let span = hits.last().unwrap().at - hits[0].at;
    let rate = 29.0 / span.as_secs_f64();
    println!("30 deliveries at 20/s: span {span:?}, {rate:.1}/s");
    assert!(
        span >= Duration::from_millis(1_400),
        "faster than the limit: {span:?}"
    );
    assert!(rate > 12.0, "far slower than the limit: {rate:.1}/s");
}

#[test]
fn a_failing_sink_does_not_delay_a_healthy_one() {
    let down = endpoint(
        &(0..40)
            .map(|i| {
                (
                    Box::leak(format!("d{i}").into_boxed_str()) as &str,
                    vec!["sleep:3000"],
                )
            })
            .collect::<Vec<_>>(),
    );
    let up = endpoint(&[]);
    let server = Server::start(|c| {
        c.sinks.insert(
            "down".into(),
            webhook_sink(&down.url, |s, _| s.max_in_flight = 2),
        );
        c.sinks.insert(
            "up".into(),
            webhook_sink(&up.url, |s, _| s.max_in_flight = 4),
        );
    });
    let at = now_ms() + 500;
    let mut messages = Vec::new();
    for i in 0..40 {
        messages
            .push(json!({"topic": "t", "body": format!("d{i}"), "deliver_at": at, "sink": "down"}));
        messages.push(
            json!({"topic": "t", "body": format!("u{i}"), "deliver_at": at + i, "sink": "up"}),
        );
    }
    post_batch(&server, messages);
    up.wait_until(40, |_| true);
    let mut lateness: Vec<i64> = up
        .hits()
        .iter()
        .map(|h| {
            let i: i64 = String::from_utf8_lossy(&h.body)[1..].parse().unwrap();
            h.at_ms - (at + i)
        })
        .collect();
    lateness.sort();
    assert_eq!(lateness.len(), 40);
    println!(
        "healthy sink beside a stuck one: lateness p50 {} ms, max {} ms",
        lateness[20], lateness[39]
    );
    assert!(lateness[0] >= 0, "never early");
    assert!(
        lateness[39] < 1_000,
        "the stuck sink's 3 s calls did not hold the healthy one back"
    );
    assert!(
        down.hits().len() <= 4,
        "the stuck sink has at most its in-flight calls open"
    );
}

#[test]
fn a_restart_in_the_middle_of_a_retry_series_continues_it() {
    let hook = endpoint(&[("again", vec!["503", "503", "ok"])]);
    let dir = tempfile::tempdir().unwrap();
    let configure = |c: &mut delayd::config::Config| {
        let sink = webhook_sink(&hook.url, |s, _| {
            s.backoff_initial = delayd::config::Millis(Duration::from_millis(1_500));
            s.backoff_multiplier = 1.0;
        });
        c.sinks.insert("hooks".into(), sink);
    };
    let server = Server::start_in(dir.path(), configure);
    let id = schedule(&server, "hooks", json!({"body": "again"}));
    assert_eq!(hook.wait_for("again", 1).len(), 1);
    // The retry is written (status shows it) before the stop.
    assert_eq!(
        settled_status(&server, &id, "retrying")["status"],
        "retrying"
    );
    drop(server);
    let server = Server::start_in(dir.path(), configure);
    let hits = hook.wait_for("again", 3);
    assert_eq!(
        hits.iter().map(|h| h.attempt).collect::<Vec<_>>(),
        vec![0, 1, 2],
        "attempt numbers carry on"
    );
    assert!(
        hits.iter().all(|h| h.id == id),
        "the same id across attempts and restarts"
    );
    let status = settled_status(&server, &id, "delivered");
    assert_eq!(
        (status["status"].as_str(), status["attempts"].as_u64()),
        (Some("delivered"), Some(3))
    );
}

/// A TLS receiver for `127.0.0.1` with a certificate from a fresh private CA. Answers 204 to every
/// request and reports each request's head and body on a channel. Returns (url, CA PEM, requests).
fn tls_endpoint(
    runtime: &tokio::runtime::Runtime,
) -> (String, String, std::sync::mpsc::Receiver<String>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate().unwrap())
        .unwrap();
    let server_key = rcgen::KeyPair::generate().unwrap();
    let server_cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&server_key, &ca)
        .unwrap();
    let key = rustls::pki_types::PrivateKeyDer::try_from(server_key.serialize_der()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![server_cert.der().clone()], key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let url = format!("https://{}/hooks", listener.local_addr().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    runtime.spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                // Read the head, then as many body bytes as content-length says.
                loop {
                    let Ok(n) = tls.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request).to_string();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length: usize = text[..end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        if request.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                let _ = tx.send(String::from_utf8_lossy(&request).to_string());
                let _ = tls
                    .write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
                    .await;
                let _ = tls.shutdown().await;
            });
        }
    });
    (url, ca.pem(), rx)
}

#[test]
fn https_endpoints_work_and_their_certificates_are_checked() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (url, ca_pem, requests) = tls_endpoint(&runtime);
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca_pem).unwrap();
    let server = Server::start(|c| {
        c.sinks.insert(
            "secure".into(),
            webhook_sink(&url, |_, w| w.ca_file = Some(ca_file.clone())),
        );
        // The same endpoint without trusting its CA: the certificate must be refused.
        c.sinks
            .insert("untrusting".into(), webhook_sink(&url, |_, _| {}));
    });
    let id = schedule(&server, "secure", json!({"body": "over tls"}));
    let request = requests
        .recv_timeout(Duration::from_secs(30))
        .expect("the TLS receiver got the webhook");
    assert!(request.starts_with("POST /hooks HTTP/1.1"), "{request}");
    assert!(request.contains(&format!("webhook-id: {id}")), "{request}");
    assert!(request.ends_with("over tls"));
    assert_eq!(
        settled_status(&server, &id, "delivered")["status"],
        "delivered"
    );

    let refused = schedule(&server, "untrusting", json!({"body": "should not arrive"}));
    // The retry is readable a moment before the first attempt's `retried` outcome, which carries the
    // reason, is recorded: wait for the reason too.
    let mut status = Value::Null;
    common::wait_for("the retry and its reason", Duration::from_secs(30), || {
        status = server
            .call("GET", &format!("/v1/messages/{refused}"), None)
            .json;
        status["status"] == "retrying" && status["reason"].is_string()
    });
    assert!(
        status["reason"].as_str().unwrap().contains("certificate"),
        "{status}"
    );
    assert!(
        requests.try_recv().is_err(),
        "nothing reached the receiver without a trusted certificate"
    );
}

#[test]
fn a_dead_letter_is_listed_then_requeued_and_delivered_or_discarded() {
    let hook = endpoint(&[("again", vec!["400", "ok"]), ("away", vec!["400"])]);
    let server = Server::start(|c| {
        c.sinks
            .insert("hooks".into(), webhook_sink(&hook.url, |_, _| {}));
    });
    let again = schedule(&server, "hooks", json!({"body": "again"}));
    let away = schedule(&server, "hooks", json!({"body": "away"}));
    let pending = schedule(&server, "hooks", json!({"body": "later", "delay": "1h"}));
    for id in [&again, &away] {
        assert_eq!(settled_status(&server, id, "dead")["status"], "dead");
    }
    let dead = server.call("GET", "/v1/messages?status=dead", None);
    let mut listed: Vec<&str> = dead.json["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["reason"], "HTTP 400: bad payload", "{m}");
            assert_eq!(m["attempts"], 1, "{m}");
            m["id"].as_str().unwrap()
        })
        .collect();
    listed.sort();
    let mut expected = vec![again.as_str(), away.as_str()];
    expected.sort();
    assert_eq!(listed, expected);

    // Bad requeues change nothing.
    let call = |path: String, body: Value| server.call("POST", &path, Some(body));
    let answer = call(
        format!("/v1/messages/{again}/requeue"),
        json!({"delay": "soon"}),
    );
    answer.assert_problem(400, "invalid_delay");
    let answer = call(format!("/v1/messages/{pending}/requeue"), json!({}));
    answer.assert_problem(409, "not_dead");
    // In the words its lookup shows.
    let detail = answer.json["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("is scheduled, not dead"), "{detail}");
    let answer = call(
        format!("/v1/messages/{}/requeue", "a".repeat(23)),
        json!({}),
    );
    assert_eq!(answer.status, 404, "{}", answer.json);

    // A requeue is a new attempt, due now: it is delivered, and the status keeps the history.
    let series = scrape(&server.base);
    let requeued_before = series["delayd_messages_requeued_total"];
    let discarded_before = series["delayd_messages_discarded_total"];
    let answer = call(format!("/v1/messages/{again}/requeue"), json!({}));
    assert_eq!(answer.status, 200, "{}", answer.json);
    assert_eq!(answer.json["status"], "retrying");
    assert_eq!(answer.json["attempts"], 1);
    let hits = hook.wait_for("again", 2);
    assert_eq!(hits.iter().map(|h| h.attempt).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(hits[0].id, hits[1].id, "the same message");
    let status = settled_status(&server, &again, "delivered");
    assert_eq!(status["status"], "delivered", "{status}");
    assert_eq!(status["attempts"], 2);
    let history = status["history"].as_array().unwrap();
    assert_eq!(history.len(), 2, "{status}");
    assert_eq!(history[0]["outcome"], "retried");
    assert_eq!(
        history[0]["reason"],
        "requeued; it had died: HTTP 400: bad payload"
    );
    assert_eq!(history[1]["outcome"], "delivered");
    // Twice is refused: it is not dead any more.
    let answer = call(format!("/v1/messages/{again}/requeue"), json!({}));
    answer.assert_problem(409, "not_dead");

    // A discard keeps it dead and takes it off the dead-letter list.
    let answer = call(format!("/v1/messages/{away}/discard"), json!({}));
    assert_eq!(answer.status, 200, "{}", answer.json);
    let status = server
        .call("GET", &format!("/v1/messages/{away}"), None)
        .json;
    assert_eq!(status["status"], "discarded", "{status}");
    assert_eq!(status["reason"], "HTTP 400: bad payload");
    let dead = server.call("GET", "/v1/messages?status=dead", None).json;
    assert_eq!(dead["messages"], json!([]), "{dead}");
    let discarded = server
        .call("GET", "/v1/messages?status=discarded", None)
        .json;
    assert_eq!(discarded["messages"][0]["id"], away.as_str());
    let answer = call(format!("/v1/messages/{away}/requeue"), json!({}));
    assert_eq!(answer.status, 409, "{}", answer.json);
    assert_eq!(hook.hits_for("away").len(), 1, "never delivered again");
    // (The counters are the process's: other tests' servers may count too.)
    let series = scrape(&server.base);
    assert!(series["delayd_messages_requeued_total"] - requeued_before >= 1.0);
    assert!(series["delayd_messages_discarded_total"] - discarded_before >= 1.0);
}
