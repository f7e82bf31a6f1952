//! A QMP client (QEMU Machine Protocol: JSON lines over the VM's control socket): one connection
//! per command, as the runtime issues a handful per VM (status, stop, cont, send-key).

use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{ControlMessage, MsgFlags};
use serde_json::{Value, json};
use std::os::fd::{AsRawFd as _, BorrowedFd};
use tokio::io::Interest;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// QEMU answers in milliseconds; a wedged one must not hang a DELETE.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("connect to QMP socket {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("QMP exchange on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("QMP on {path} closed the connection")]
    Closed { path: PathBuf },
    #[error("QMP on {path} sent a line that is not JSON: {line:?}")]
    Decode { path: PathBuf, line: String },
    #[error("QEMU refused {command}: {desc}")]
    Refused { command: String, desc: String },
    #[error("QMP on {path} did not answer {command} within {CALL_TIMEOUT:?}")]
    Timeout { path: PathBuf, command: String },
}

#[derive(Debug, Clone)]
pub struct Qmp {
    socket: PathBuf,
}

impl Qmp {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Run one command (after the capabilities handshake); its `return` value.
    pub async fn execute(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        tokio::time::timeout(CALL_TIMEOUT, self.exchange(None, command, arguments))
            .await
            .map_err(|_| QmpError::Timeout {
                path: self.socket.clone(),
                command: command.into(),
            })?
    }

    /// Hand QEMU descriptor `fd` as `name` (`getfd`, the descriptor passed with SCM_RIGHTS),
    /// then run `command` in the same session (a named descriptor belongs to the monitor).
    pub async fn execute_with_fd(
        &self,
        fd: BorrowedFd<'_>,
        name: &str,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        tokio::time::timeout(
            CALL_TIMEOUT,
            self.exchange(Some((fd, name)), command, arguments),
        )
        .await
        .map_err(|_| QmpError::Timeout {
            path: self.socket.clone(),
            command: command.into(),
        })?
    }

    async fn exchange(
        &self,
        handed: Option<(BorrowedFd<'_>, &str)>,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let path = self.socket.clone();
        let stream = UnixStream::connect(&path)
            .await
            .map_err(|source| QmpError::Connect {
                path: path.clone(),
                source,
            })?;
        let (read, mut write) = stream.into_split();
        let path2 = path.clone();
        let io2 = move |source| QmpError::Io {
            path: path2.clone(),
            source,
        };
        let mut lines = BufReader::new(read).lines();
        let io = |source| QmpError::Io {
            path: path.clone(),
            source,
        };
        // Greeting, then capabilities negotiation, then the command.
        let mut next = async || -> Result<Value, QmpError> {
            loop {
                let line = lines
                    .next_line()
                    .await
                    .map_err(io)?
                    .ok_or_else(|| QmpError::Closed { path: path.clone() })?;
                let v: Value = serde_json::from_str(&line).map_err(|_| QmpError::Decode {
                    path: path.clone(),
                    line: line.clone(),
                })?;
                // Asynchronous events may arrive at any time: not answers.
                if v.get("event").is_none() {
                    return Ok(v);
                }
            }
        };
        next().await?;
        let mut send = async |cmd: &str,
                              args: Option<Value>,
                              fd: Option<BorrowedFd<'_>>|
               -> Result<(), QmpError> {
            let mut msg = json!({ "execute": cmd });
            if let Some(a) = args {
                msg["arguments"] = a;
            }
            let mut text = msg.to_string();
            text.push('\n');
            let Some(fd) = fd else {
                return write.write_all(text.as_bytes()).await.map_err(&io2);
            };
            // The descriptor rides on the command's own bytes (SCM_RIGHTS).
            let sock: &UnixStream = write.as_ref();
            let sent = sock
                .async_io(Interest::WRITABLE, || {
                    let raw = [fd.as_raw_fd()];
                    nix::sys::socket::sendmsg::<()>(
                        sock.as_raw_fd(),
                        &[std::io::IoSlice::new(text.as_bytes())],
                        &[ControlMessage::ScmRights(&raw)],
                        MsgFlags::empty(),
                        None,
                    )
                    .map_err(std::io::Error::from)
                })
                .await
                .map_err(&io2)?;
            if sent != text.len() {
                return Err(io2(std::io::Error::other(format!("{cmd} sent in part"))));
            }
            Ok(())
        };
        send("qmp_capabilities", None, None).await?;
        answer("qmp_capabilities", next().await?)?;
        if let Some((fd, name)) = handed {
            send("getfd", Some(json!({ "fdname": name })), Some(fd)).await?;
            answer("getfd", next().await?)?;
        }
        send(command, arguments, None).await?;
        answer(command, next().await?)
    }
}

fn answer(command: &str, v: Value) -> Result<Value, QmpError> {
    if let Some(r) = v.get("return") {
        return Ok(r.clone());
    }
    let desc = v
        .pointer("/error/desc")
        .and_then(Value::as_str)
        .unwrap_or("no description")
        .to_string();
    Err(QmpError::Refused {
        command: command.into(),
        desc,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A QMP server stand-in: greeting, one answer per command line, events in between.
    async fn serve(listener: UnixListener, answers: Vec<Value>) -> Vec<Value> {
        let (s, _) = listener.accept().await.unwrap();
        let (r, mut w) = s.into_split();
        let mut lines = BufReader::new(r).lines();
        w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        for a in answers {
            let line = lines.next_line().await.unwrap().unwrap();
            got.push(serde_json::from_str(&line).unwrap());
            w.write_all(b"{\"event\": \"RESUME\", \"timestamp\": {}}\n")
                .await
                .unwrap();
            w.write_all(format!("{a}\n").as_bytes()).await.unwrap();
        }
        got
    }

    #[tokio::test]
    async fn a_command_after_the_handshake_returns_its_value_past_events() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("qmp.sock");
        let server = tokio::spawn(serve(
            UnixListener::bind(&sock).unwrap(),
            vec![
                json!({"return": {}}),
                json!({"return": {"status": "running", "running": true}}),
            ],
        ));
        let r = Qmp::new(&sock).execute("query-status", None).await.unwrap();
        assert_eq!(r["status"], "running");
        let got = server.await.unwrap();
        assert_eq!(got[0], json!({"execute": "qmp_capabilities"}));
        assert_eq!(got[1], json!({"execute": "query-status"}));
    }

    #[tokio::test]
    async fn a_refusal_carries_qemus_description() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("qmp.sock");
        let server = tokio::spawn(serve(
            UnixListener::bind(&sock).unwrap(),
            vec![
                json!({"return": {}}),
                json!({"error": {"class": "GenericError", "desc": "no such key"}}),
            ],
        ));
        let e = Qmp::new(&sock)
            .execute("send-key", Some(json!({"keys": []})))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, QmpError::Refused { command, desc } if command == "send-key" && desc == "no such key"),
            "{e}"
        );
        let got = server.await.unwrap();
        assert_eq!(got[1]["arguments"], json!({"keys": []}));
    }

    #[tokio::test]
    async fn a_descriptor_is_handed_with_getfd_in_the_commands_session() {
        use std::io::{Read as _, Seek as _, Write as _};
        use std::os::fd::{AsFd as _, FromRawFd as _};
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("qmp.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(b"{\"QMP\": {}}\n").unwrap();
            let mut lines = Vec::new();
            let mut received = None;
            for _ in 0..3 {
                // One command per read: the client waits for each answer.
                let mut buf = [0u8; 512];
                let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
                let mut iov = [std::io::IoSliceMut::new(&mut buf)];
                let msg = nix::sys::socket::recvmsg::<()>(
                    s.as_raw_fd(),
                    &mut iov,
                    Some(&mut space),
                    MsgFlags::empty(),
                )
                .unwrap();
                for c in msg.cmsgs().unwrap() {
                    if let nix::sys::socket::ControlMessageOwned::ScmRights(fds) = c {
                        received = Some(fds[0]);
                    }
                }
                let n = msg.bytes;
                let line = String::from_utf8_lossy(&buf[..n]).trim().to_string();
                lines.push(serde_json::from_str::<Value>(&line).unwrap());
                s.write_all(b"{\"return\": {}}\n").unwrap();
            }
            // SAFETY: the descriptor SCM_RIGHTS installed in this process.
            let mut f = unsafe { std::fs::File::from_raw_fd(received.expect("an fd")) };
            f.rewind().unwrap();
            let mut text = String::new();
            f.read_to_string(&mut text).unwrap();
            (lines, text)
        });
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(b"stream").unwrap();
        Qmp::new(&sock)
            .execute_with_fd(
                file.as_fd(),
                "impsuspend",
                "migrate",
                Some(json!({"uri": "fd:impsuspend"})),
            )
            .await
            .unwrap();
        let (lines, text) = server.join().unwrap();
        assert_eq!(
            lines[1],
            json!({"execute": "getfd", "arguments": {"fdname": "impsuspend"}})
        );
        assert_eq!(lines[2]["arguments"]["uri"], "fd:impsuspend");
        assert_eq!(text, "stream", "QEMU got the runtime's file");
    }

    #[tokio::test]
    async fn no_socket_is_a_connect_error() {
        let e = Qmp::new("/nonexistent/qmp.sock")
            .execute("query-status", None)
            .await
            .unwrap_err();
        assert!(matches!(e, QmpError::Connect { .. }), "{e}");
    }
}
