//! Peer traffic between cluster members (DESIGN.md §10): an authenticated request/response link on a
//! listener of its own (`cluster.listen`), so that client load and the HTTP edge's limits never starve
//! it. What travels over it (Raft's votes, appends and snapshots) is its callers' business: a request
//! is a kind byte and a payload, an answer a payload or an error text.
//!
//! ```text
//! handshake (both sides prove they hold the secret; neither shows its proof to a side that has not)
//!   client → server  b"DLYDPEER", version u16 LE, client's node id u64 LE, client nonce [32]
//!   server → client  server nonce [32], HMAC-SHA256(secret, "server" | client nonce | server nonce | id)
//!   client → server  HMAC-SHA256(secret, "client" | server nonce | client nonce | id)
//!   server → client  1 byte: 1 accepted (a refused client is disconnected without an answer)
//! then, one request at a time per connection (a client keeps a few connections per peer)
//!   request          len u32 LE (of what follows), kind u8, payload
//!   answer           len u32 LE (of what follows), status u8 (0 ok, 1 error: the payload is its text),
//!                    payload
//! ```
//!
//! Invariants:
//! - Nothing but a handshake is read from a connection that has not proved the secret, and a handshake
//!   that does not finish within [`PeerOptions::handshake_timeout`] ends the connection; proofs are
//!   compared in constant time. The secret never crosses the wire, and each proof covers both sides'
//!   fresh random nonces, so a recorded one is worth nothing later.
//! - A request or answer longer than [`PeerOptions::max_frame_bytes`] is refused before it is read.
//! - Peer traffic is authenticated, not encrypted: like Raft's own traffic in most deployments it
//!   belongs on a private network.
//! - Every call has a deadline ([`PeerOptions::request_timeout`]); a connection whose call failed or
//!   timed out is dropped, never reused (its stream may hold the late answer).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MAGIC: &[u8; 8] = b"DLYDPEER";
const VERSION: u16 = 1;
const NONCE_LEN: usize = 32;
const PROOF_LEN: usize = 32;
const ACCEPTED: u8 = 1;
const STATUS_OK: u8 = 0;
const STATUS_ERROR: u8 = 1;

/// The shortest `cluster.secret` a member starts with: anything shorter is guessable.
pub const MIN_SECRET_BYTES: usize = 16;

/// How long peer traffic may take.
#[derive(Debug, Clone)]
pub struct PeerOptions {
    pub connect_timeout: Duration,
    /// For a connection to prove itself, on both sides.
    pub handshake_timeout: Duration,
    /// For one call: its request written and its answer read.
    pub request_timeout: Duration,
    pub max_frame_bytes: usize,
    /// Idle connections a client keeps per peer.
    pub pool: usize,
}

impl Default for PeerOptions {
    fn default() -> PeerOptions {
        PeerOptions {
            connect_timeout: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            max_frame_bytes: 64 << 20,
            pool: 4,
        }
    }
}

/// What went wrong on the link to a peer.
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
    /// The peer took the request and answered with an error of its own.
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

impl Secret {
    fn new(secret: &str) -> Result<Secret, PeerError> {
        match secret.len() >= MIN_SECRET_BYTES {
            true => Ok(Secret(secret.as_bytes().into())),
            false => Err(PeerError::WeakSecret),
        }
    }

    fn mac(&self, role: &[u8], first: &[u8], second: &[u8], id: u64) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(role);
        mac.update(first);
        mac.update(second);
        mac.update(&id.to_le_bytes());
        mac
    }

    fn proof(&self, role: &[u8], first: &[u8], second: &[u8], id: u64) -> [u8; PROOF_LEN] {
        self.mac(role, first, second, id)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is this secret's, compared in constant time.
    fn verify(&self, role: &[u8], first: &[u8], second: &[u8], id: u64, proof: &[u8]) -> bool {
        self.mac(role, first, second, id)
            .verify_slice(proof)
            .is_ok()
    }
}

fn nonce() -> [u8; NONCE_LEN] {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).expect("the OS gives random bytes");
    nonce
}

/// Answers the requests of authenticated peers.
pub trait PeerService: Send + Sync + 'static {
    /// The answer to a request of `kind` from the member `from`, or the error text the caller gets.
    fn handle(
        &self,
        from: u64,
        kind: u8,
        payload: Vec<u8>,
    ) -> futures_core::future::BoxFuture<'_, Result<Vec<u8>, String>>;
}

/// Serves peers on `listener` until the returned future is dropped: each connection proves the secret,
/// then its requests go to `service` one at a time. Refuses a secret shorter than [`MIN_SECRET_BYTES`]
/// before anything is served.
pub fn serve(
    listener: TcpListener,
    secret: &str,
    options: PeerOptions,
    service: Arc<dyn PeerService>,
) -> Result<impl std::future::Future<Output = ()> + Send + 'static, PeerError> {
    let secret = Secret::new(secret)?;
    Ok(async move {
        loop {
            let (stream, addr) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, most likely: wait for some to be let go, not spin.
                    tracing::warn!(error = %e, "accepting a peer connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (secret, options, service) = (secret.clone(), options.clone(), service.clone());
            tokio::spawn(async move {
                let _ = stream.set_nodelay(true);
                if let Err(e) = serve_connection(stream, addr, &secret, &options, service).await {
                    tracing::debug!(peer = %addr, error = %e, "peer connection ended");
                }
            });
        }
    })
}

async fn serve_connection(
    mut stream: TcpStream,
    addr: SocketAddr,
    secret: &Secret,
    options: &PeerOptions,
    service: Arc<dyn PeerService>,
) -> Result<(), PeerError> {
    let io = |source| PeerError::Io { peer: addr, source };
    let from = within(addr, "the handshake", options.handshake_timeout, async {
        let mut hello = [0u8; 8 + 2 + 8 + NONCE_LEN];
        stream.read_exact(&mut hello).await.map_err(io)?;
        let refused = |why: &str| PeerError::Refused {
            peer: addr,
            why: why.into(),
        };
        if &hello[..8] != MAGIC {
            return Err(refused("not a delayd peer"));
        }
        let version = u16::from_le_bytes([hello[8], hello[9]]);
        if version != VERSION {
            return Err(refused(&format!(
                "peer protocol version {version}, this member speaks {VERSION}"
            )));
        }
        let from = u64::from_le_bytes(hello[10..18].try_into().expect("8 bytes"));
        let client_nonce = &hello[18..];
        let server_nonce = nonce();
        let mut answer = [0u8; NONCE_LEN + PROOF_LEN];
        answer[..NONCE_LEN].copy_from_slice(&server_nonce);
        answer[NONCE_LEN..].copy_from_slice(&secret.proof(
            b"server",
            client_nonce,
            &server_nonce,
            from,
        ));
        stream.write_all(&answer).await.map_err(io)?;
        let mut proof = [0u8; PROOF_LEN];
        stream.read_exact(&mut proof).await.map_err(io)?;
        if !secret.verify(b"client", &server_nonce, client_nonce, from, &proof) {
            tracing::warn!(peer = %addr, "a peer connection did not prove cluster.secret; closed");
            return Err(refused("wrong cluster.secret"));
        }
        stream.write_all(&[ACCEPTED]).await.map_err(io)?;
        Ok(from)
    })
    .await?;
    loop {
        let Some((kind, payload)) = read_frame(&mut stream, options.max_frame_bytes)
            .await
            .map_err(io)?
        else {
            return Ok(()); // the client closed between requests
        };
        let (status, answer) = match service.handle(from, kind, payload).await {
            Ok(answer) => (STATUS_OK, answer),
            Err(text) => (STATUS_ERROR, text.into_bytes()),
        };
        write_frame(&mut stream, status, &answer)
            .await
            .map_err(io)?;
    }
}

/// Reads one frame: `None` if the stream ended before it began.
async fn read_frame(stream: &mut TcpStream, max: usize) -> std::io::Result<Option<(u8, Vec<u8>)>> {
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len - 1 > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes (at most {} are taken)", max + 1),
        ));
    }
    let mut frame = vec![0u8; len];
    stream.read_exact(&mut frame).await?;
    let payload = frame.split_off(1);
    Ok(Some((frame[0], payload)))
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

/// Calls one peer: connects and proves the secret when it has no idle connection, keeps a few.
#[derive(Debug)]
pub struct PeerClient {
    peer: SocketAddr,
    /// This member's id, which the peer is told.
    id: u64,
    secret: Secret,
    options: PeerOptions,
    idle: Mutex<Vec<TcpStream>>,
}

impl PeerClient {
    pub fn new(
        peer: SocketAddr,
        id: u64,
        secret: &str,
        options: PeerOptions,
    ) -> Result<PeerClient, PeerError> {
        Ok(PeerClient {
            peer,
            id,
            secret: Secret::new(secret)?,
            options,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Sends a request of `kind` and waits for its answer.
    pub async fn call(&self, kind: u8, payload: &[u8]) -> Result<Vec<u8>, PeerError> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut stream = match idle {
            Some(stream) => stream,
            None => self.connect().await?,
        };
        let peer = self.peer;
        let io = |source| PeerError::Io { peer, source };
        let max = self.options.max_frame_bytes;
        let answered = within(peer, "a request", self.options.request_timeout, async {
            write_frame(&mut stream, kind, payload).await.map_err(io)?;
            match read_frame(&mut stream, max).await.map_err(io)? {
                Some(answer) => Ok(answer),
                None => Err(io(std::io::ErrorKind::UnexpectedEof.into())),
            }
        })
        .await?;
        // Only a connection whose call ended cleanly goes back to the pool.
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < self.options.pool {
            idle.push(stream);
        }
        drop(idle);
        match answered {
            (STATUS_OK, answer) => Ok(answer),
            (_, text) => Err(PeerError::Answered {
                peer,
                text: String::from_utf8_lossy(&text).into_owned(),
            }),
        }
    }

    async fn connect(&self) -> Result<TcpStream, PeerError> {
        let peer = self.peer;
        let io = |source| PeerError::Io { peer, source };
        let mut stream = within(peer, "connecting", self.options.connect_timeout, async {
            TcpStream::connect(peer).await.map_err(io)
        })
        .await?;
        let _ = stream.set_nodelay(true);
        within(
            peer,
            "the handshake",
            self.options.handshake_timeout,
            async {
                let client_nonce = nonce();
                let mut hello = Vec::with_capacity(8 + 2 + 8 + NONCE_LEN);
                hello.extend_from_slice(MAGIC);
                hello.extend_from_slice(&VERSION.to_le_bytes());
                hello.extend_from_slice(&self.id.to_le_bytes());
                hello.extend_from_slice(&client_nonce);
                stream.write_all(&hello).await.map_err(io)?;
                let mut answer = [0u8; NONCE_LEN + PROOF_LEN];
                stream.read_exact(&mut answer).await.map_err(io)?;
                let (server_nonce, proof) = answer.split_at(NONCE_LEN);
                if !self
                    .secret
                    .verify(b"server", &client_nonce, server_nonce, self.id, proof)
                {
                    return Err(PeerError::Refused {
                        peer,
                        why: "it did not prove cluster.secret".into(),
                    });
                }
                let proof = self
                    .secret
                    .proof(b"client", server_nonce, &client_nonce, self.id);
                stream.write_all(&proof).await.map_err(io)?;
                let mut accepted = [0u8; 1];
                match stream.read_exact(&mut accepted).await {
                    Ok(_) if accepted[0] == ACCEPTED => Ok(()),
                    _ => Err(PeerError::Refused {
                        peer,
                        why: "it refused this member's proof of cluster.secret".into(),
                    }),
                }
            },
        )
        .await?;
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_core::future::BoxFuture;

    const SECRET: &str = "a long random string";

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

    fn quick() -> PeerOptions {
        PeerOptions {
            handshake_timeout: Duration::from_millis(500),
            request_timeout: Duration::from_millis(500),
            max_frame_bytes: 1024,
            ..PeerOptions::default()
        }
    }

    /// A member serving [`Echo`] on a loopback port, until the test ends.
    async fn member(secret: &str) -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let served = serve(listener, secret, quick(), Arc::new(Echo)).unwrap();
        (addr, tokio::spawn(served))
    }

    /// The member closes `raw` without sending it a byte (a reset counts: it closes with unread bytes).
    async fn assert_closed_unanswered(mut raw: TcpStream) {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), raw.read_to_end(&mut rest)).await;
        let reset = |e: &std::io::Error| e.kind() == std::io::ErrorKind::ConnectionReset;
        match read {
            Ok(Ok(0)) => {}
            Ok(Err(e)) if reset(&e) && rest.is_empty() => {}
            other => panic!("not closed unanswered: {other:?}, {rest:?}"),
        }
    }

    #[tokio::test]
    async fn an_authenticated_peer_gets_its_answers_over_a_few_connections() {
        let (addr, _served) = member(SECRET).await;
        let client = Arc::new(PeerClient::new(addr, 7, SECRET, quick()).unwrap());
        let calls = (0..16u8).map(|i| {
            let client = client.clone();
            tokio::spawn(async move { (i, client.call(0, &[i; 3]).await) })
        });
        for call in calls {
            let (i, answer) = call.await.unwrap();
            let answer = answer.unwrap();
            assert_eq!(answer[..8], 7u64.to_le_bytes(), "the peer knows who called");
            assert_eq!(answer[8..], [i; 3]);
        }
        let idle = client.idle.lock().unwrap().len();
        assert!(
            (1..=quick().pool).contains(&idle),
            "{idle} idle connections kept"
        );
        match client.call(1, b"x").await {
            Err(PeerError::Answered { text, .. }) => assert_eq!(text, "refused on purpose"),
            other => panic!("{other:?}"),
        }
        assert_eq!(client.call(0, b"after").await.unwrap()[8..], *b"after");
    }

    #[tokio::test]
    async fn a_wrong_secret_is_refused_whichever_side_holds_it() {
        let (addr, _served) = member(SECRET).await;
        let stranger = PeerClient::new(addr, 7, "another long random string", quick()).unwrap();
        match stranger.call(0, b"x").await {
            Err(PeerError::Refused { why, .. }) => assert!(why.contains("did not prove"), "{why}"),
            other => panic!("{other:?}"),
        }
        // A client that answers the server's proof with a wrong one of its own is closed on, unanswered.
        let mut raw = TcpStream::connect(addr).await.unwrap();
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&VERSION.to_le_bytes());
        hello.extend_from_slice(&7u64.to_le_bytes());
        hello.extend_from_slice(&[0u8; NONCE_LEN]);
        raw.write_all(&hello).await.unwrap();
        let mut answer = [0u8; NONCE_LEN + PROOF_LEN];
        raw.read_exact(&mut answer).await.unwrap();
        raw.write_all(&[0u8; PROOF_LEN]).await.unwrap();
        assert_closed_unanswered(raw).await;
    }

    #[tokio::test]
    async fn a_short_secret_is_refused_at_the_start() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let served = serve(listener, "short", quick(), Arc::new(Echo));
        assert!(matches!(served, Err(PeerError::WeakSecret)));
        let client = PeerClient::new(addr, 1, "", quick());
        assert!(matches!(client, Err(PeerError::WeakSecret)));
    }

    #[tokio::test]
    async fn silence_ends_in_a_timeout_on_both_sides() {
        let (addr, _served) = member(SECRET).await;
        let client = PeerClient::new(addr, 7, SECRET, quick()).unwrap();
        match client.call(2, b"x").await {
            Err(PeerError::Timeout { what, .. }) => assert_eq!(what, "a request"),
            other => panic!("{other:?}"),
        }
        assert!(
            client.idle.lock().unwrap().is_empty(),
            "a timed-out connection is not kept"
        );
        assert_eq!(client.call(0, b"y").await.unwrap()[8..], *b"y");
        // A listener that accepts and says nothing: the handshake times out.
        let mute = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = PeerClient::new(mute.local_addr().unwrap(), 7, SECRET, quick()).unwrap();
        match client.call(0, b"x").await {
            Err(PeerError::Timeout { what, .. }) => assert_eq!(what, "the handshake"),
            other => panic!("{other:?}"),
        }
        // A connection that never proves itself is closed by the member.
        let raw = TcpStream::connect(addr).await.unwrap();
        assert_closed_unanswered(raw).await;
    }

    #[tokio::test]
    async fn strangers_and_oversized_frames_are_refused() {
        let (addr, _served) = member(SECRET).await;
        let mut raw = TcpStream::connect(addr).await.unwrap();
        raw.write_all(
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0",
        )
        .await
        .unwrap();
        assert_closed_unanswered(raw).await;
        let client = PeerClient::new(addr, 7, SECRET, quick()).unwrap();
        match client.call(0, &[0u8; 2048]).await {
            Err(PeerError::Io { .. }) => {}
            other => panic!("a frame past max_frame_bytes: {other:?}"),
        }
        assert_eq!(client.call(0, b"small").await.unwrap()[8..], *b"small");
    }
}
