//! Inputs the fuzz targets (`fuzz/`, see fuzz/README.md) found, replayed in the normal test
//! suite with the fixes they led to. Semantics found along the way are also tested next to
//! their code (`braces.rs`, `shard/mod.rs`); this file keeps the exact inputs.
//!
//! Its own test binary, because of the allocator: any single allocation over 256 MiB aborts
//! the process, so "a header claimed 4 GiB and we allocated it" fails here even on a machine
//! whose overcommit would have let the allocation succeed.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;

use bytes::Bytes;
use futures::executor::block_on;
use shardd::config::Config;
use shardd::config::braces::{self, BraceError};
use shardd::protocol::{self, MAX_CLIENT_FRAME};
use shardd::shard::manifest::Manifest;

struct Capped;

const CAP: usize = 256 << 20;

// SAFETY: forwards to the system allocator unchanged, except that it reports failure (null)
// for requests over CAP, which GlobalAlloc allows.
unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from System through this allocator, with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: as for dealloc; the caller's contract for `realloc` is passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Capped = Capped;

/// `frame` target, oom-7858ee30: five bytes of a frame header claiming a 2.2 GB body, then
/// 127 bytes. `read_frame` allocated (and zeroed) the whole body before reading any of it;
/// the Rust client reads daemon frames with no limit below 4 GiB, so a hostile or broken
/// peer cost it gigabytes per frame. Now the body grows as bytes arrive.
#[test]
fn a_frame_header_is_no_reason_to_allocate_its_body() {
    let mut input = b"SHA\x84\x00".to_vec();
    input.extend_from_slice(&[b'x'; 127]);
    let err = block_on(protocol::read_frame(&mut &input[..], u32::MAX)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);

    let mut input = u32::MAX.to_le_bytes().to_vec();
    input.push(3);
    let err = block_on(protocol::read_frame(&mut &input[..], u32::MAX)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);

    // The daemon's own limit still refuses before reading.
    let err = block_on(protocol::read_frame(&mut &input[..], MAX_CLIENT_FRAME)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "frame of 4294967295 bytes is over the limit of 65536"
    );

    // A whole frame larger than the first allocation still arrives byte for byte.
    let body: Vec<u8> = (0..9 << 20).map(|i: u32| (i % 251) as u8).collect();
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.push(3);
    frame.extend_from_slice(&body);
    let (kind, got) = block_on(protocol::read_frame(&mut &frame[..], u32::MAX)).unwrap();
    assert_eq!(kind, 3);
    assert!(got == body);
}

/// `batch_decode` target, crash-7745e308: a 38-byte BATCH body whose header says 2^31 + 1
/// samples. `decode_batch` reserved room for all of them up front (150 GiB).
#[test]
fn a_batch_header_is_no_reason_to_allocate_its_samples() {
    let body = [
        0x01, 0x00, 0x00, 0x80, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00,
        0x00, 0x25, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x75, 0x00,
        0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x6b,
    ];
    let err = protocol::decode_batch(Bytes::copy_from_slice(&body)).unwrap_err();
    assert_eq!(err, "batch frame is shorter than its header says");

    // u32::MAX samples of u16::MAX fields each, in a 32-byte body.
    let mut body = Vec::new();
    for word in [u32::MAX, 2, 0, 0, 32, 0, 0xffff_0000, 0] {
        body.extend_from_slice(&word.to_le_bytes());
    }
    let err = protocol::decode_batch(Bytes::from(body)).unwrap_err();
    assert_eq!(err, "batch frame is shorter than its header says");
}

/// `braces` target, timeout-52afb48b: a pattern over the limit was expanded (up to ten
/// million names) before it was refused, which took seconds and a gigabyte. Now it is
/// counted first. Also found while porting: ends and steps near i64::MAX overflowed.
#[test]
fn brace_patterns_over_the_limit_are_refused_without_expanding() {
    for pattern in [
        "{,,#\0\0\0\r80,\u{1}09}1\0\0\0\u{5}{3167573..0}", // the input found: 12.7M names
        "{0..9}{0..999999}{0..9}",
        "{0..9999999}{a,b}",
    ] {
        assert_eq!(
            braces::expand(pattern),
            Err(BraceError::TooMany),
            "{pattern}"
        );
    }
    assert_eq!(
        braces::expand("{-9223372036854775808..9223372036854775807..9223372036854775807}").unwrap(),
        ["-9223372036854775808", "-1", "9223372036854775806"]
    );
    assert_eq!(
        braces::expand("{0..-9..-9223372036854775808}").unwrap(),
        ["0"]
    );
}

/// `config` target: absurd durations panicked in `Duration::from_secs_f64`; the same input
/// shapes, replayed through the whole parser.
#[test]
fn absurd_config_values_are_errors() {
    for (extra, want) in [
        (
            "[server]\nhandshake_timeout = \"99999999999999999999999999h\"",
            "invalid config: server.handshake_timeout \"99999999999999999999999999h\" is too long",
        ),
        (
            "[store]\npart_size = \"9999999999999999999999TiB\"",
            "invalid config: store.part_size \"9999999999999999999999TiB\" is too large",
        ),
    ] {
        let text = format!("[datasets.d]\nshards = \"/x/a.tar\"\n{extra}\n");
        let err = Config::parse(&text, Path::new("/"))
            .unwrap_err()
            .to_string();
        assert_eq!(err, want);
    }
}

/// `manifest` target: sample counts or sizes whose sum passes u64 overflowed while checking
/// the totals (a panic in debug builds, a wrapped total that could pass in release).
#[test]
fn manifest_totals_past_u64_are_an_error() {
    let entry = |name: &str| {
        format!(
            r#"{{"url": "s3://b/{name}.tar", "size": 9223372036854775808, "e_tag": null,
                "generation": null, "crc32c": 0, "samples": 9223372036854775808}}"#
        )
    };
    let text = format!(
        r#"{{"format": 1, "shards": [{}, {}], "total_samples": 0, "total_bytes": 0}}"#,
        entry("a"),
        entry("b")
    );
    let err = Manifest::parse(text.as_bytes(), "gs://b/m.json").unwrap_err();
    assert_eq!(
        err.to_string(),
        "manifest gs://b/m.json: its totals do not add up"
    );
}
