//! BATCH encode → decode is the identity, on arbitrary samples (keys, URLs, field names and
//! data of any size the fuzzer picks, small and large pieces mixed). Also checks the header
//! words a client relies on to read a batch without reading ahead: the frame length,
//! `payload_offset` and `max_piece`, and that batches respect their sample limit.
#![cfg_attr(not(test), no_main)]

use std::collections::VecDeque;
use std::sync::Arc;

#[cfg(test)] // tests/fuzz_seeds.rs checks what each seed reached
use crate::reached;
use arbitrary::Arbitrary;
use bytes::Bytes;
#[cfg(not(test))] // tests/fuzz_seeds.rs has its own
use libfuzzer_sys::fuzz_target;
use shardd::cache::ShardBytes;
use shardd::protocol::{self, BATCH_MAX_SAMPLES, HEADER_LEN, Kind};
use shardd::shard::Sample;

/// What a seed reached: recorded by tests/fuzz_seeds.rs, nothing in the fuzz build.
#[cfg(not(test))]
fn reached(_: impl AsRef<str>) {}

#[derive(Debug, Arbitrary)]
struct Input {
    urls: Vec<String>,
    names: Vec<String>,
    samples: Vec<InSample>,
}

#[derive(Debug, Arbitrary)]
struct InSample {
    key: String,
    url: u8,
    fields: Vec<(u8, Piece)>,
}

/// Field data: fuzzer bytes, or a long run (to reach the out-of-line path over 4 KiB and the
/// batch cut near 1 MiB without megabyte inputs).
#[derive(Debug, Arbitrary)]
enum Piece {
    Bytes(Vec<u8>),
    Run { byte: u8, len: u16, times: u8 },
}

fuzz_target!(|input: Input| {
    if input.urls.is_empty() || input.names.is_empty() {
        return reached("no urls or names");
    }
    let urls: Vec<Arc<str>> = input.urls.iter().map(|u| Arc::from(u.as_str())).collect();
    let names: Vec<Arc<str>> = input.names.iter().map(|n| Arc::from(n.as_str())).collect();
    let samples: Vec<Sample> = input
        .samples
        .iter()
        .map(|s| Sample {
            key: s.key.clone().into(),
            url: urls[s.url as usize % urls.len()].clone(),
            fields: s
                .fields
                .iter()
                .map(|(n, piece)| {
                    let data = match piece {
                        Piece::Bytes(b) => b.clone(),
                        Piece::Run { byte, len, times } => {
                            vec![*byte; *len as usize * (*times as usize % 4 + 1)]
                        }
                    };
                    (
                        names[*n as usize % names.len()].clone(),
                        ShardBytes::heap(Bytes::from(data)),
                    )
                })
                .collect(),
        })
        .collect();

    // A few MiB reach every cut (1 MiB, 4096 samples, out-of-line pieces) at fuzzing speed.
    let total: usize = samples.iter().map(Sample::payload_len).sum();
    if total > 3 << 20 {
        return reached("too large");
    }
    let mut queue: VecDeque<Sample> = samples.iter().cloned().collect();
    let mut decoded = Vec::new();
    while !queue.is_empty() {
        let before = queue.len();
        let (parts, sent) = protocol::encode_batch(&mut queue).unwrap();
        assert!(!sent.is_empty() && sent.len() <= BATCH_MAX_SAMPLES);
        assert_eq!(queue.len() + sent.len(), before);
        let frame: Vec<u8> = parts.iter().map(|p| p.bytes()).collect::<Vec<_>>().concat();
        let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - HEADER_LEN);
        assert_eq!(frame[4], Kind::Batch as u8);
        let body = &frame[HEADER_LEN..];
        let word = |i: usize| u32::from_le_bytes(body[4 * i..4 * i + 4].try_into().unwrap());
        let payload: usize = sent.iter().map(Sample::payload_len).sum();
        assert_eq!(word(4) as usize, body.len() - payload, "payload_offset");
        let max_piece = sent
            .iter()
            .flat_map(|s| std::iter::once(s.key.len()).chain(s.fields.iter().map(|(_, d)| d.len())))
            .max()
            .unwrap();
        assert_eq!(word(5) as usize, max_piece, "max_piece");
        decoded.extend(protocol::decode_batch(Bytes::copy_from_slice(body)).unwrap());
    }
    assert_eq!(decoded.len(), samples.len());
    for (got, want) in decoded.iter().zip(&samples) {
        assert_eq!(got.key, want.key.as_str());
        assert_eq!(got.url, &*want.url);
        assert_eq!(got.fields.len(), want.fields.len());
        for ((gn, gd), (wn, wd)) in got.fields.iter().zip(&want.fields) {
            assert_eq!(gn, &**wn);
            assert_eq!(&gd[..], &wd[..]);
        }
    }
    reached("round trip");
});
