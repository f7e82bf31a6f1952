//! Frame codec: one frame = u32 big-endian payload length + that many bytes of JSON.
//!
//! The pure part ([`FrameDecoder`], [`encode`]) is what the fuzz target drives; [`FrameReader`]
//! and [`FrameWriter`] wrap it around async streams. The reader can be seeded with bytes that
//! were read before framing started (the hybrid-vsock `OK` line may arrive in the same read as
//! the first frame).

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::protocol::{ErrorCode, Message};

/// Largest accepted payload, both directions. Exec env (the JIT config is a few KiB) is the
/// largest legitimate message; 1 MiB leaves room without letting a peer make us buffer much.
pub const MAX_FRAME_BYTES: usize = 1024 * 1024;

const LEN_PREFIX: usize = 4;
const READ_CHUNK: usize = 16 * 1024;
/// Unknown type names are echoed back in errors; cap them so a hostile name stays small.
const MAX_ECHOED_TYPE: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame length {len} exceeds the maximum of {max} bytes")]
    TooLarge { len: u64, max: usize },
    #[error("frame payload is not valid JSON (line {line}, column {column})")]
    NotJson { line: usize, column: usize },
    #[error("frame payload is not a JSON object with a string `type` field")]
    MissingType,
    #[error("unknown message type {0:?}")]
    UnknownType(String),
    #[error("invalid `{type_name}` message: {detail}")]
    InvalidMessage { type_name: String, detail: String },
    #[error("connection closed in the middle of a frame ({buffered} bytes buffered)")]
    Truncated { buffered: usize },
    #[error("could not encode message: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("i/o error on the frame stream: {0}")]
    Io(#[from] std::io::Error),
}

impl FrameError {
    /// True when the offending frame was consumed whole, so the stream is still aligned on a
    /// frame boundary and the connection can go on after answering with an error.
    pub fn is_recoverable(&self) -> bool {
        matches!(
            self,
            FrameError::NotJson { .. }
                | FrameError::MissingType
                | FrameError::UnknownType(_)
                | FrameError::InvalidMessage { .. }
        )
    }

    /// The protocol error code to report this decode failure with.
    pub fn error_code(&self) -> ErrorCode {
        match self {
            FrameError::TooLarge { .. } => ErrorCode::FrameTooLarge,
            FrameError::UnknownType(_) => ErrorCode::UnknownType,
            FrameError::NotJson { .. }
            | FrameError::MissingType
            | FrameError::InvalidMessage { .. } => ErrorCode::InvalidMessage,
            FrameError::Truncated { .. } | FrameError::Encode(_) | FrameError::Io(_) => {
                ErrorCode::Internal
            }
        }
    }
}

/// Serialize `msg` into one frame (prefix included).
pub fn encode<M: Serialize>(msg: &M) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![0u8; LEN_PREFIX];
    serde_json::to_writer(&mut out, msg).map_err(FrameError::Encode)?;
    let len = out.len() - LEN_PREFIX;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge {
            len: len as u64,
            max: MAX_FRAME_BYTES,
        });
    }
    out[..LEN_PREFIX].copy_from_slice(&(len as u32).to_be_bytes());
    Ok(out)
}

#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(rename = "type", borrow, default)]
    ty: Option<Cow<'a, str>>,
}

/// Decode one frame payload (without the length prefix) as a message of direction `M`.
pub fn decode_payload<M: Message>(payload: &[u8]) -> Result<M, FrameError> {
    // Classify first, so a peer gets "unknown type" rather than serde's variant list, and
    // a malformed Exec never has its (secret-bearing) content quoted back.
    let envelope: Envelope<'_> = serde_json::from_slice(payload).map_err(|e| {
        if e.is_syntax() || e.is_eof() {
            FrameError::NotJson {
                line: e.line(),
                column: e.column(),
            }
        } else {
            FrameError::MissingType
        }
    })?;
    let ty = envelope.ty.ok_or(FrameError::MissingType)?;
    if !M::TYPES.contains(&ty.as_ref()) {
        let mut name = ty.into_owned();
        if name.len() > MAX_ECHOED_TYPE {
            let mut cut = MAX_ECHOED_TYPE;
            while !name.is_char_boundary(cut) {
                cut -= 1;
            }
            name.truncate(cut);
        }
        return Err(FrameError::UnknownType(name));
    }
    serde_json::from_slice(payload).map_err(|e| {
        let detail = if M::SECRET_BEARING.contains(&ty.as_ref()) {
            format!(
                "wrong field shape at line {} column {} (details withheld: may carry secrets)",
                e.line(),
                e.column()
            )
        } else {
            e.to_string()
        };
        FrameError::InvalidMessage {
            type_name: ty.into_owned(),
            detail,
        }
    })
}

/// Incremental decoder: feed bytes with [`extend`](Self::extend), take frames with
/// [`decode_next`](Self::decode_next). After a non-recoverable error it must not be used again.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder that starts with bytes already read from the stream.
    pub fn with_buffered(buf: Vec<u8>) -> Self {
        Self { buf }
    }

    pub fn extend(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete frame, `Ok(None)` if more bytes are needed. A recoverable error
    /// consumes the bad frame; `TooLarge` consumes nothing (the connection should be closed).
    pub fn decode_next<M: Message>(&mut self) -> Result<Option<M>, FrameError> {
        let Some(prefix) = self.buf.first_chunk::<LEN_PREFIX>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(*prefix) as usize;
        if len > MAX_FRAME_BYTES {
            return Err(FrameError::TooLarge {
                len: len as u64,
                max: MAX_FRAME_BYTES,
            });
        }
        let end = LEN_PREFIX + len;
        if self.buf.len() < end {
            return Ok(None);
        }
        let result = decode_payload::<M>(&self.buf[LEN_PREFIX..end]);
        self.buf.drain(..end);
        result.map(Some)
    }
}

/// Reads frames of direction `M` from an async stream.
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    decoder: FrameDecoder,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            decoder: FrameDecoder::new(),
        }
    }

    /// Start with `buffered` bytes that were read from `inner` before framing began.
    pub fn with_buffered(inner: R, buffered: Vec<u8>) -> Self {
        Self {
            inner,
            decoder: FrameDecoder::with_buffered(buffered),
        }
    }

    /// The next message; `Ok(None)` on a clean end of stream at a frame boundary.
    /// Cancel safe: bytes read so far stay in the decoder.
    pub async fn read<M: Message>(&mut self) -> Result<Option<M>, FrameError> {
        let mut chunk = [0u8; READ_CHUNK];
        loop {
            if let Some(msg) = self.decoder.decode_next()? {
                return Ok(Some(msg));
            }
            let n = self.inner.read(&mut chunk).await?;
            if n == 0 {
                return match self.decoder.buffered() {
                    0 => Ok(None),
                    buffered => Err(FrameError::Truncated { buffered }),
                };
            }
            self.decoder.extend(&chunk[..n]);
        }
    }

    pub fn into_inner(self) -> R {
        self.inner
    }
}

/// Writes whole frames (prefix + payload in one write, then flush).
#[derive(Debug)]
pub struct FrameWriter<W> {
    inner: W,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    pub fn new(inner: W) -> Self {
        Self { inner }
    }

    pub async fn write<M: Serialize>(&mut self, msg: &M) -> Result<(), FrameError> {
        let bytes = encode(msg)?;
        self.inner.write_all(&bytes).await?;
        self.inner.flush().await?;
        Ok(())
    }

    /// Raw bytes, for tests that need to send what the encoder would refuse.
    pub async fn write_raw(&mut self, bytes: &[u8]) -> Result<(), FrameError> {
        self.inner.write_all(bytes).await?;
        self.inner.flush().await?;
        Ok(())
    }

    pub async fn shutdown(&mut self) -> Result<(), FrameError> {
        self.inner.shutdown().await?;
        Ok(())
    }

    pub fn into_inner(self) -> W {
        self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{GuestToHost, HostToGuest, HttpProbe, Started};

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut v = (payload.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn roundtrip_byte_by_byte() {
        let msg = GuestToHost::Started(Started {
            id: "x".into(),
            pid: 42,
        });
        let bytes = encode(&msg).unwrap();
        assert_eq!(
            u32::from_be_bytes(bytes[..4].try_into().unwrap()) as usize,
            bytes.len() - 4
        );
        let mut dec = FrameDecoder::new();
        for (i, b) in bytes.iter().enumerate() {
            assert!(
                dec.decode_next::<GuestToHost>().unwrap().is_none(),
                "complete early at {i}"
            );
            dec.extend(&[*b]);
        }
        assert_eq!(dec.decode_next::<GuestToHost>().unwrap(), Some(msg));
        assert_eq!(dec.buffered(), 0);
    }

    #[test]
    fn two_frames_in_one_buffer() {
        let a = HostToGuest::Metrics;
        let b = HostToGuest::HttpProbe(HttpProbe {
            path: "/h".into(),
            port: 8080,
            timeout_ms: 5,
        });
        let mut bytes = encode(&a).unwrap();
        bytes.extend(encode(&b).unwrap());
        let mut dec = FrameDecoder::with_buffered(bytes);
        // HostToGuest has no PartialEq (Exec env values are secrets): compare the wire values.
        let json = |m: Option<HostToGuest>| m.map(|m| serde_json::to_value(m).unwrap());
        assert_eq!(json(dec.decode_next().unwrap()), json(Some(a)));
        assert_eq!(json(dec.decode_next().unwrap()), json(Some(b)));
        assert!(dec.decode_next::<HostToGuest>().unwrap().is_none());
    }

    #[test]
    fn oversize_rejected_before_payload_arrives() {
        let mut dec =
            FrameDecoder::with_buffered(((MAX_FRAME_BYTES + 1) as u32).to_be_bytes().to_vec());
        let err = dec.decode_next::<HostToGuest>().unwrap_err();
        assert!(
            matches!(err, FrameError::TooLarge { len, .. } if len == MAX_FRAME_BYTES as u64 + 1)
        );
        assert!(!err.is_recoverable());
        assert_eq!(err.error_code(), ErrorCode::FrameTooLarge);
    }

    #[test]
    fn max_size_frame_accepted() {
        let pad = "a".repeat(MAX_FRAME_BYTES - r#"{"type":"metrics","pad":""}"#.len());
        let payload = format!(r#"{{"type":"metrics","pad":"{pad}"}}"#);
        assert_eq!(payload.len(), MAX_FRAME_BYTES);
        let mut dec = FrameDecoder::with_buffered(frame(payload.as_bytes()));
        assert!(matches!(
            dec.decode_next::<HostToGuest>().unwrap(),
            Some(HostToGuest::Metrics)
        ));
    }

    #[test]
    fn encode_refuses_oversize() {
        let big = GuestToHost::Started(Started {
            id: "x".repeat(MAX_FRAME_BYTES),
            pid: 1,
        });
        assert!(matches!(encode(&big), Err(FrameError::TooLarge { .. })));
    }

    #[test]
    fn decode_errors_are_precise_and_recoverable() {
        type Check = fn(&FrameError) -> bool;
        let cases: Vec<(&[u8], Check)> = vec![
            (b"not json", |e| matches!(e, FrameError::NotJson { .. })),
            (b"", |e| matches!(e, FrameError::NotJson { .. })),
            (b"[1,2]", |e| matches!(e, FrameError::MissingType)),
            (b"{\"id\":1}", |e| matches!(e, FrameError::MissingType)),
            (b"{\"type\":7}", |e| matches!(e, FrameError::MissingType)),
            (
                b"{\"type\":\"launch_missiles\"}",
                |e| matches!(e, FrameError::UnknownType(t) if t == "launch_missiles"),
            ),
            // A guest->host type is unknown in the host->guest direction.
            (b"{\"type\":\"hello\"}", |e| {
                matches!(e, FrameError::UnknownType(_))
            }),
            (
                b"{\"type\":\"http_probe\",\"port\":\"x\"}",
                |e| matches!(e, FrameError::InvalidMessage { type_name, .. } if type_name == "http_probe"),
            ),
        ];
        let mut bytes = Vec::new();
        for (payload, _) in &cases {
            bytes.extend(frame(payload));
        }
        bytes.extend(encode(&HostToGuest::Metrics).unwrap());
        let mut dec = FrameDecoder::with_buffered(bytes);
        for (payload, check) in &cases {
            let err = dec.decode_next::<HostToGuest>().unwrap_err();
            assert!(
                check(&err),
                "{:?} -> {err:?}",
                String::from_utf8_lossy(payload)
            );
            assert!(err.is_recoverable());
        }
        // The stream stayed aligned: the good frame after the bad ones decodes.
        assert!(matches!(
            dec.decode_next::<HostToGuest>().unwrap(),
            Some(HostToGuest::Metrics)
        ));
    }

    #[test]
    fn malformed_exec_error_does_not_echo_values() {
        let payload = br#"{"type":"exec","id":"a","argv":["x"],"env":{"JIT":12345678}}"#;
        let err = decode_payload::<HostToGuest>(payload).unwrap_err();
        assert!(matches!(err, FrameError::InvalidMessage { .. }));
        assert!(!err.to_string().contains("12345678"), "{err}");
        let payload = br#"{"type":"exec","id":"a","argv":"topsecret"}"#;
        let err = decode_payload::<HostToGuest>(payload).unwrap_err();
        assert!(!err.to_string().contains("topsecret"), "{err}");
    }

    #[test]
    fn unknown_type_name_is_capped() {
        let payload = format!(r#"{{"type":"{}"}}"#, "é".repeat(100));
        match decode_payload::<HostToGuest>(payload.as_bytes()).unwrap_err() {
            FrameError::UnknownType(t) => assert!(t.len() <= MAX_ECHOED_TYPE),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn reader_keeps_seeded_bytes_and_reports_truncation() {
        let first = encode(&HostToGuest::Metrics).unwrap();
        let second = encode(&HostToGuest::Shutdown).unwrap();
        // Seed with the first frame plus half of the second; the stream holds the rest.
        let split = first.len() + 3;
        let mut all = first.clone();
        all.extend(&second);
        let (seed, rest) = all.split_at(split);
        let mut reader = FrameReader::with_buffered(rest, seed.to_vec());
        assert!(matches!(
            reader.read::<HostToGuest>().await.unwrap(),
            Some(HostToGuest::Metrics)
        ));
        assert!(matches!(
            reader.read::<HostToGuest>().await.unwrap(),
            Some(HostToGuest::Shutdown)
        ));
        assert!(reader.read::<HostToGuest>().await.unwrap().is_none());

        let cut = &second[..second.len() - 1];
        let mut reader = FrameReader::new(cut);
        assert!(matches!(
            reader.read::<HostToGuest>().await,
            Err(FrameError::Truncated { .. })
        ));
    }
}
