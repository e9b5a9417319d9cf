//! The Rust client's BATCH decoder on arbitrary bodies (what a broken or hostile daemon could
//! send). Properties: it never panics or allocates beyond the body it was given, and whatever
//! it accepts means the same thing after encode → decode (the encoder and the decoder agree on
//! every batch the decoder accepts).
#![cfg_attr(not(test), no_main)]

use std::collections::VecDeque;
use std::sync::Arc;

#[cfg(test)] // tests/fuzz_seeds.rs checks what each seed reached
use crate::reached;
use bytes::Bytes;
#[cfg(not(test))] // tests/fuzz_seeds.rs has its own
use libfuzzer_sys::fuzz_target;
use shardd::cache::ShardBytes;
use shardd::protocol::{self, HEADER_LEN, Kind, ReceivedSample};
use shardd::shard::{MAX_FIELDS, Sample};

/// What a seed reached: recorded by tests/fuzz_seeds.rs, nothing in the fuzz build.
#[cfg(not(test))]
fn reached(_: impl AsRef<str>) {}

fuzz_target!(|data: &[u8]| {
    let Ok(got) = protocol::decode_batch(Bytes::copy_from_slice(data)) else {
        return reached("refused");
    };
    // Every accepted byte of payload came from the body.
    let payload: usize = got
        .iter()
        .map(|s| s.key.len() + s.fields.iter().map(|(_, d)| d.len()).sum::<usize>())
        .sum();
    assert!(payload <= data.len());

    // Encodable: the encoder's limits (fields per sample; the batch cut) still apply.
    if got.iter().any(|s| s.fields.len() > MAX_FIELDS) {
        return reached("decoded, not encodable");
    }
    let mut queue: VecDeque<Sample> = got.iter().map(to_sample).collect();
    let mut again: Vec<ReceivedSample> = Vec::new();
    while !queue.is_empty() {
        let (parts, _) = protocol::encode_batch(&mut queue).unwrap();
        let frame: Vec<u8> = parts.iter().map(|p| p.bytes()).collect::<Vec<_>>().concat();
        assert_eq!(frame[4], Kind::Batch as u8);
        let body = Bytes::copy_from_slice(&frame[HEADER_LEN..]);
        again.extend(protocol::decode_batch(body).expect("our own batch decodes"));
    }
    assert_eq!(again, got);
    reached("round trip");
});

fn to_sample(s: &ReceivedSample) -> Sample {
    Sample {
        key: s.key.clone().into(),
        url: Arc::from(s.url.as_str()),
        fields: s
            .fields
            .iter()
            .map(|(n, d)| (Arc::from(n.as_str()), ShardBytes::heap(d.clone())))
            .collect(),
    }
}
