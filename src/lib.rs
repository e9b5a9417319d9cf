//! shardd: one daemon per training host that streams shuffled WebDataset samples from object
//! storage to the host's trainer processes over a Unix socket.
//!
//! # Layout
//! A folder per stage of the data flow, which runs one way: store → cache → shard → plan →
//! serve, with config, ops and `blocks` below every stage and the commands above them. A module
//! imports only from its own stage, the stages before it, `config`, `ops` and `blocks`; `protocol`
//! (frames of samples, requests of plans) sits between plan and serve, `client` above it.
//! (Unit tests may reach further for fixtures.)
//!
//! | stage | folder | job |
//! |---|---|---|
//! | config | `config/` | TOML (`file`) → validated (`validate`) [`config::Config`]; sizes and durations (`values`), `merge-config` (`merge`), the cache's sizing (`space`); shard patterns (`braces`), shard URLs (`url`), the host's place in the job (`host`) |
//! | store | `store/` | reads a shard from its source: credentials asked once, ranged parallel GETs checksummed as they land, verification, local copies |
//! | cache | `cache/` | the host-level shard source: verified entries on disk, hard budget, pins, single flight, eviction, decompression |
//! | shard | `shard/` | tar bytes → WebDataset samples (zero-copy slices); where each sample of a cached shard lies (`sample_index`); per-shard sizes, checksums, counts (`manifest`) |
//! | plan | `plan/` | (dataset, seed, epoch, topology, rank, worker) → which samples, in which order: shares, `shuffle`, `mix`, `elastic`, and [`plan::request`], the one entry point the server calls |
//! | serve | `serve/` | the daemon (`daemon`), the Unix socket (`server`), one stream per connection (`stream`), frames to the socket (`sink`) or by reference (`mapped`, zero copy), `prefetch`, `/status` and HTTP |
//! | protocol, client | `protocol.rs`, `client.rs` | frames of `proto/PROTOCOL.md`; the Rust client (`cat`, `demo`, tests) |
//! | blocks | `blocks.rs` | how every cache file is written: whole, aligned blocks (`cache.block_size`), for large page-cache folios; used by `store` (downloads, local copies) and `cache` (decompression) |
//! | ops | `ops/` | Prometheus metrics, systemd readiness and watchdog, progress lines, malloc tuning |
//! | commands | `cmd/` | `demo`, `warm`, `index`, `plan` (the report), `install-units` and `merge-config` (`units`) |
//!
//! `main.rs` only parses the command line.

pub mod blocks;
pub mod cache;
pub mod client;
pub mod cmd;
pub mod config;
pub mod ops;
pub mod plan;
pub mod protocol;
pub mod serve;
pub mod shard;
pub mod store;
