//! shardd: one daemon per training host that streams shuffled WebDataset samples from object
//! storage to the host's trainer processes over a Unix socket.
//!
//! # Layout
//! The data flows in one direction, one module per box:
//!
//! | box | file | job |
//! |---|---|---|
//! | config | `config.rs` | TOML → validated runtime [`config::Config`] |
//! | shard lists | `braces.rs` | `train-{000000..000639}.tar` → shard URLs |
//! | shard URLs | `url.rs` | one shard's location, object names verbatim |
//! | store | `store/` | reads a shard from its source: credentials asked once, ranged parallel GETs checksummed as they land, verification, local copies |
//! | cache | `cache/` | the host-level shard source: verified entries on disk, hard budget, pins, single flight, eviction |
//! | prefetch | `prefetch.rs` | what to load next, from the plans of the open streams (and their next epoch) |
//! | manifest | `manifest.rs` | per-shard sizes, ETags, checksums, sample counts (`shardd index`) |
//! | plan | `plan.rs` | (seed, epoch, topology, rank, worker) → which samples (pieces of shards), in which order |
//! | elastic | `elastic.rs` | a checkpoint's rest of the epoch, redistributed over another topology |
//! | shard | `shard.rs` | tar bytes → WebDataset samples (zero-copy slices) |
//! | sample index | `sample_index.rs` | where each sample of a cached shard lies: a shard read again is not parsed again |
//! | shuffle | `shuffle.rs` | seeded generator; windowed sample shuffle |
//! | stream | `stream.rs` | one stream: shards from the cache → parse → shuffle → batch frames |
//! | protocol | `protocol.rs` | frames of `proto/PROTOCOL.md`, shared by server and client |
//! | sink | `sink.rs` | writes frames; shard pages go to the socket by reference (splice) |
//! | server | `server.rs` | Unix socket: accept, handshake, one stream per connection |
//! | client | `client.rs` | Rust client (used by `cat`, `demo`, tests) |
//! | metrics, http, status | `metrics.rs`, `http.rs`, `status.rs` | Prometheus registry; `/metrics`, `/healthz`, `/readyz`, `/status` |
//! | host | `host.rs` | `host.index`/`host.count = "auto"`: environment, then the TPU VM metadata server |
//! | systemd | `systemd.rs` | `Type=notify` readiness, watchdog, socket activation |
//! | daemon | `daemon.rs` | wires the boxes together, binds, shuts down |
//! | demo | `demo.rs` | `shardd demo`: a synthetic dataset through the whole daemon |
//!
//! `main.rs` only parses the command line.

pub mod braces;
pub mod cache;
pub mod client;
pub mod config;
pub mod daemon;
pub mod demo;
pub mod elastic;
pub mod host;
pub mod http;
pub mod manifest;
pub mod mapped;
pub mod metrics;
pub mod mix;
pub mod plan;
pub mod prefetch;
pub mod protocol;
pub mod sample_index;
pub mod server;
pub mod shard;
pub mod shuffle;
pub mod sink;
pub mod status;
pub mod store;
pub mod stream;
pub mod systemd;
pub mod url;
