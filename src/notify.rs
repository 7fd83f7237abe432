//! The service manager's readiness protocol (systemd's `sd_notify`), without libsystemd: one datagram
//! of `KEY=VALUE` lines to the Unix socket named by `$NOTIFY_SOCKET`.
//!
//! - `READY=1` once recovery is done and the listener serves (the same moment as the `delayd ready`
//!   line and `GET /readyz` answering 200), so `Type=notify` units start their dependants only then.
//! - `STOPPING=1` when a graceful stop begins.
//! - A name starting with `@` is a socket in the abstract namespace. Without `$NOTIFY_SOCKET` (not
//!   under systemd) a notice is a no-op. A notice that cannot be sent is logged, never fatal: the
//!   service works the same, only the manager does not hear of it.

use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Sends `state` (e.g. `"READY=1"`) to the service manager, if there is one.
pub fn notify(state: &str) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(error) = send(&socket, state) {
        tracing::warn!(%error, socket = ?socket, state, "could not notify the service manager");
    }
}

fn send(socket: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = socket.as_bytes();
    let address = match bytes.strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name)?
        }
        None => SocketAddr::from_pathname(socket)?,
    };
    let datagram = UnixDatagram::unbound()?;
    datagram.send_to_addr(state.as_bytes(), &address)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notice_reaches_a_path_socket_and_an_abstract_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let receiver = UnixDatagram::bind(&path).unwrap();
        send(path.as_os_str(), "READY=1").unwrap();
        let mut buffer = [0u8; 64];
        let n = receiver.recv(&mut buffer).unwrap();
        assert_eq!(&buffer[..n], b"READY=1");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("delayd-notify-test-{}", std::process::id());
        let receiver =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
                .unwrap();
        send(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let n = receiver.recv(&mut buffer).unwrap();
        assert_eq!(&buffer[..n], b"STOPPING=1");
    }
}
