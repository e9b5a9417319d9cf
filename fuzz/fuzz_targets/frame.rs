//! The frame reader on both sides of the socket, and the daemon's handshake parsing.
//!
//! Input: the bytes a peer sends. Properties:
//! - `read_frame` returns exactly the header's kind and the `len` bytes after the header, and
//!   consumes nothing more; it refuses a frame over the limit (the daemon's 64 KiB, the
//!   client's 4 GiB) and a frame cut short. It must not allocate what the header claims
//!   before the bytes arrive (a 5-byte header saying 4 GiB is not 4 GiB of memory).
//! - The daemon's view (preamble, then a REQUEST frame of JSON): a request that parses
//!   survives encode → decode unchanged.
#![cfg_attr(not(test), no_main)]

#[cfg(test)] // tests/fuzz_seeds.rs checks what each seed reached
use crate::reached;
use futures::executor::block_on;
#[cfg(not(test))] // tests/fuzz_seeds.rs has its own
use libfuzzer_sys::fuzz_target;
use shardd::protocol::{self, HEADER_LEN, Kind, MAX_CLIENT_FRAME, PREAMBLE_LEN, Request};

/// What a seed reached: recorded by tests/fuzz_seeds.rs, nothing in the fuzz build.
#[cfg(not(test))]
fn reached(_: impl AsRef<str>) {}

fn check_read_frame(data: &[u8], max: u32) {
    let mut rest = data;
    let got = block_on(protocol::read_frame(&mut rest, max));
    let consumed = data.len() - rest.len();
    if data.len() < HEADER_LEN {
        assert!(got.is_err(), "a frame without a whole header");
        return;
    }
    let len = u32::from_le_bytes(data[..4].try_into().unwrap());
    match got {
        Ok((kind, body)) => {
            assert!(len <= max, "accepted {len} bytes over the limit {max}");
            assert_eq!(kind, data[4]);
            assert_eq!(body.len(), len as usize);
            assert_eq!(&body[..], &data[HEADER_LEN..HEADER_LEN + len as usize]);
            assert_eq!(consumed, HEADER_LEN + len as usize, "read past the frame");
        }
        Err(e) => {
            let short = data.len() < HEADER_LEN + len as usize;
            assert!(
                len > max || short,
                "refused a whole frame within the limit: {e}"
            );
            if len > max {
                assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
            } else {
                assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // Daemon side (client → daemon, 64 KiB limit) and client side (daemon → client, no limit
    // but the u32 length).
    check_read_frame(data, MAX_CLIENT_FRAME);
    check_read_frame(data, u32::MAX);

    // The daemon's handshake: preamble, then one REQUEST frame.
    if data.len() < PREAMBLE_LEN {
        return reached("no preamble");
    }
    let preamble: &[u8; PREAMBLE_LEN] = data[..PREAMBLE_LEN].try_into().unwrap();
    let version = protocol::parse_preamble(preamble);
    assert_eq!(version.is_some(), data.starts_with(protocol::MAGIC));
    let mut rest = &data[PREAMBLE_LEN..];
    let Ok((kind, body)) = block_on(protocol::read_frame(&mut rest, MAX_CLIENT_FRAME)) else {
        return reached("no frame after the preamble");
    };
    if kind != Kind::Request as u8 {
        return reached("not a REQUEST frame");
    }
    if let Ok(req) = serde_json::from_slice::<Request>(&body) {
        let frame = protocol::json_frame(Kind::Request, &req);
        let (kind, body) = block_on(protocol::read_frame(&mut &frame[..], u32::MAX)).unwrap();
        assert_eq!(kind, Kind::Request as u8);
        let again: Request = serde_json::from_slice(&body).unwrap();
        assert_eq!(again, req);
        reached("request");
    } else {
        reached("REQUEST frame, not a request");
    }
});
