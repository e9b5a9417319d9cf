//! `shardd demo`: writes a small synthetic WebDataset to a temp dir, serves it from a
//! local-directory store through the whole daemon (socket, plan, shuffle, protocol), reads one
//! epoch for several ranks and workers through the Rust client, and checks what it got:
//! every sample exactly once, every byte as written, the same order when read again, a
//! different order next epoch.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, bail, ensure};
use tokio_util::sync::CancellationToken;

use crate::client;
use crate::config::Config;
use crate::plan::shuffle::SplitMix64;
use crate::protocol::{ReceivedSample, Request};

const SHARDS: usize = 16;
const SAMPLES_PER_SHARD: usize = 250;
const WORLD_SIZE: u32 = 4;
const NUM_WORKERS: u32 = 2;

/// Random bytes that sample payloads are cut from.
fn pool() -> &'static [u8] {
    static POOL: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let mut rng = SplitMix64::new(0);
        (0..(1 << 17))
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect()
    })
}

/// The fields of sample `i`, derived from `i` alone so the reader can check every byte.
fn fields_of(i: usize) -> Vec<(&'static str, Vec<u8>)> {
    let mut rng = SplitMix64::new(i as u64);
    let len = 8_000 + rng.below(56_000) as usize;
    let at = rng.below((pool().len() - len) as u64) as usize;
    vec![
        ("jpg", pool()[at..at + len].to_vec()),
        ("cls", (i % 1000).to_string().into_bytes()),
        ("json", format!("{{\"index\": {i}}}").into_bytes()),
    ]
}

fn key_of(i: usize) -> String {
    format!("images/sample{i:06}")
}

fn write_dataset(dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for s in 0..SHARDS {
        let path = dir.join(format!("demo-{s:06}.tar"));
        let mut tar = tar::Builder::new(std::fs::File::create(&path)?);
        for i in s * SAMPLES_PER_SHARD..(s + 1) * SAMPLES_PER_SHARD {
            for (field, data) in fields_of(i) {
                let mut h = tar::Header::new_ustar();
                h.set_size(data.len() as u64);
                h.set_mode(0o644);
                tar.append_data(&mut h, format!("{}.{field}", key_of(i)), &data[..])?;
                total += data.len() as u64;
            }
        }
        tar.finish()?;
    }
    Ok(total)
}

pub async fn run() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let data = tmp.path().join("data");
    std::fs::create_dir(&data)?;
    let written = write_dataset(&data)?;
    let socket = tmp.path().join("shardd.sock");
    let config_text = format!(
        r#"
        [server]
        socket = "{socket}"
        metrics_addr = ""
        [cache]
        dir = "{cache}"
        [datasets.demo]
        shards = "data/demo-{{000000..{last:06}}}.tar"
        shuffle_buffer = 1000
        "#,
        socket = socket.display(),
        cache = tmp.path().join("cache").display(),
        last = SHARDS - 1,
    );
    let config = Config::parse(&config_text, tmp.path())?;
    println!(
        "demo: {SHARDS} shards x {SAMPLES_PER_SHARD} samples ({:.1} MB) in {}",
        written as f64 / 1e6,
        data.display()
    );

    let shutdown = CancellationToken::new();
    let daemon = tokio::spawn(crate::serve::daemon::run(config, shutdown.clone()));
    let result = read_and_verify(&socket).await;
    shutdown.cancel();
    daemon.await?.context("daemon")?;
    result
}

async fn read_epoch(socket: &Path, epoch: u64) -> anyhow::Result<Vec<Vec<ReceivedSample>>> {
    let mut tasks = Vec::new();
    for rank in 0..WORLD_SIZE {
        for worker in 0..NUM_WORKERS {
            let socket = socket.to_path_buf();
            let req = Request {
                worker,
                num_workers: NUM_WORKERS,
                ..Request::stream("demo", epoch, rank, WORLD_SIZE)
            };
            tasks.push(tokio::spawn(async move {
                client::read_all(&socket, &req).await
            }));
        }
    }
    let mut streams = Vec::new();
    for t in tasks {
        streams.push(t.await??);
    }
    Ok(streams)
}

async fn read_and_verify(socket: &Path) -> anyhow::Result<()> {
    // The daemon binds in its own task: wait for the socket with a deadline.
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        ensure!(
            Instant::now() < deadline,
            "the daemon did not start listening within 10 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }

    let started = Instant::now();
    let streams = read_epoch(socket, 0).await?;
    let elapsed = started.elapsed().as_secs_f64();

    let total = SHARDS * SAMPLES_PER_SHARD;
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut bytes = 0u64;
    for s in streams.iter().flatten() {
        *seen.entry(s.key.clone()).or_default() += 1;
        let i: usize = s
            .key
            .trim_start_matches("images/sample")
            .parse()
            .context("key")?;
        let want = fields_of(i);
        ensure!(
            s.fields.len() == want.len(),
            "{}: {} fields, expected {}",
            s.key,
            s.fields.len(),
            want.len()
        );
        for ((name, data), (want_name, want_data)) in s.fields.iter().zip(&want) {
            ensure!(
                name == want_name && data[..] == want_data[..],
                "{}: field {name} differs",
                s.key
            );
            bytes += data.len() as u64;
        }
        ensure!(
            s.url.contains("demo-"),
            "{}: unexpected __url__ {}",
            s.key,
            s.url
        );
    }
    ensure!(
        seen.len() == total,
        "got {} distinct samples, expected {total}",
        seen.len()
    );
    if let Some((k, n)) = seen.iter().find(|(_, n)| **n != 1) {
        bail!("sample {k} was served {n} times");
    }
    let n = streams.iter().map(Vec::len).sum::<usize>();
    println!(
        "epoch 0: {WORLD_SIZE} ranks x {NUM_WORKERS} workers, {n} samples, {:.1} MB in {elapsed:.3} s: {:.0} samples/s, {:.0} MB/s",
        bytes as f64 / 1e6,
        n as f64 / elapsed,
        bytes as f64 / 1e6 / elapsed
    );
    println!("verified: every sample exactly once, every field byte for byte");

    let again = read_epoch(socket, 0).await?;
    let keys = |ss: &[Vec<ReceivedSample>]| -> Vec<Vec<String>> {
        ss.iter()
            .map(|s| s.iter().map(|x| x.key.clone()).collect())
            .collect()
    };
    ensure!(
        keys(&again) == keys(&streams),
        "re-reading epoch 0 gave a different order"
    );
    println!("verified: re-reading epoch 0 gives the same order in every stream");
    let next = read_epoch(socket, 1).await?;
    ensure!(
        keys(&next) != keys(&streams),
        "epoch 1 has the same order as epoch 0"
    );
    println!("verified: epoch 1 has a different order");
    Ok(())
}
