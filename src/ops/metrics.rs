//! Prometheus metrics, in a registry owned by the daemon. Base units, counters end in
//! `_total`, and no label has per-sample or per-shard cardinality.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// The outcomes of a store request (`store::Outcome`'s labels).
pub const STORE_OUTCOMES: [&str; 5] = ["ok", "throttled", "unavailable", "timeout", "error"];

pub struct Metrics {
    pub registry: Registry,
    pub connections_active: IntGauge,
    pub connections_total: IntCounter,
    pub connections_rejected_total: IntCounter,
    pub streams_active: IntGauge,
    /// Ended streams by dataset and outcome: completed, failed, cancelled (client left or
    /// shutdown).
    pub streams_total: IntCounterVec,
    /// Per dataset.
    pub samples_sent_total: IntCounterVec,
    pub bytes_sent_total: IntCounterVec,
    /// Per dataset: time streams waited for shard data with nothing to send (the trainer
    /// starves)...
    pub stream_wait_seconds_total: prometheus::CounterVec,
    /// ...and time they waited for the client to take what was ready (the trainer is the
    /// bottleneck). Their ratio to wall time is the stall fraction, both ways.
    pub client_wait_seconds_total: prometheus::CounterVec,
    /// Per dataset: from a stream's request to its first sample sent.
    pub first_sample_seconds: prometheus::HistogramVec,
    /// Object-store request latency (to the response head), by kind.
    pub store_request_seconds: prometheus::HistogramVec,
    /// `version` label: the build that is running.
    pub build_info: prometheus::IntGaugeVec,
    pub process_cpu_seconds_total: prometheus::Counter,
    pub process_resident_memory_bytes: IntGauge,
    pub process_open_fds: IntGauge,
    pub shard_fetches_total: IntCounter,
    pub shard_fetch_errors_total: IntCounter,
    pub shard_fetch_bytes_total: IntCounter,
    pub shard_fetch_seconds: Histogram,
    pub downloads_active: IntGauge,
    /// Object-store HTTP requests by kind (head, get: one per ranged part and per retry) and
    /// outcome (ok, throttled, unavailable, timeout, error: `store/retry.rs`).
    pub store_requests_total: IntCounterVec,
    /// Per bucket: the request rate this host holds itself to (`store/pacing.rs`); 0 while
    /// there is no limit.
    pub store_request_rate_limit: prometheus::GaugeVec,
    /// Time requests a trainer waited for spent held back by the store's pushback: waiting
    /// for the host's request rate (`paced`) or before a retry (`backoff`).
    pub store_wait_seconds_total: prometheus::CounterVec,
    /// Body bytes received from object stores.
    pub store_bytes_total: IntCounter,
    /// Object-store errors by kind (not_found, changed, pushback, other).
    pub store_errors_total: IntCounterVec,
    /// Bytes the cache charges against `cache.max_size`: entries plus reservations.
    pub cache_bytes: IntGauge,
    /// The most `cache_bytes` has been since the daemon started: a budget check that a
    /// scrape between two peaks cannot miss.
    pub cache_bytes_max: IntGauge,
    pub cache_capacity_bytes: IntGauge,
    /// Bytes of complete entries on disk.
    pub cache_resident_bytes: IntGauge,
    /// Bytes of entries that open streams are reading (never evicted).
    pub cache_pinned_bytes: IntGauge,
    /// A stream asked for a shard and it was ready (hit), or had to wait for it (miss).
    pub cache_hits_total: IntCounter,
    pub cache_misses_total: IntCounter,
    pub cache_evictions_total: IntCounter,
    /// Entries or downloads whose size or checksum did not verify (never served).
    pub cache_verify_failures_total: IntCounter,
    /// Bytes the prefetcher brought in before any stream asked for them.
    pub cache_prefetched_bytes_total: IntCounter,
    /// Shards a stream needed that found no space within `cache.space_timeout` (the stream
    /// fails with `cache_full`): the cache is too small for what the open streams hold.
    pub cache_full_total: IntCounter,
    /// Times a stream was parked: its client took no byte for `server.stall_timeout`, so
    /// the stream let go of its shards until the client reads again.
    pub stream_parks_total: IntCounter,
    /// Streams parked now.
    pub streams_parked: IntGauge,
    /// `shardd get` requests answered (`served`: the cache file was handed over) or refused
    /// (an unknown shard, a failed fetch), and the bytes of the files handed over.
    pub gets_total: IntCounterVec,
    pub get_bytes_total: IntCounter,
    /// Shard files zero-copy clients hold mapped now (each pins its cache entry).
    pub zero_copy_maps: IntGauge,
    /// Bytes those maps pin (at most server.zero_copy_share of the cache budget).
    pub zero_copy_mapped_bytes: IntGauge,
    pub sample_index_bytes: IntGauge,
    pub shards_parsed_total: IntCounter,
    /// Per mix: the schedule entry its streams last sent a frame under (0: the mix's first
    /// weights, n: the schedule's n-th entry).
    pub mix_schedule_entry: prometheus::IntGaugeVec,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let metrics = Self::unlabelled();
        metrics.init_labels();
        metrics
    }

    fn unlabelled() -> Metrics {
        let registry = Registry::new_custom(Some("shardd".into()), None).expect("valid prefix");
        fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
            r.register(Box::new(m.clone()))
                .expect("metric names are unique");
            m
        }
        let gauge = |name: &str, help: &str| reg(&registry, IntGauge::new(name, help).unwrap());
        let counter = |name: &str, help: &str| reg(&registry, IntCounter::new(name, help).unwrap());
        Metrics {
            connections_active: gauge("connections_active", "Open client connections."),
            connections_total: counter("connections_total", "Client connections accepted."),
            connections_rejected_total: counter(
                "connections_rejected_total",
                "Connections refused because server.max_connections were open.",
            ),
            streams_active: gauge("streams_active", "Sample streams being served."),
            streams_total: counters(&registry, "streams_total", "Streams ended, by dataset and outcome.", &["dataset", "outcome"]),
            samples_sent_total: counters(&registry, "samples_sent_total", "Samples sent to clients, by dataset.", &["dataset"]),
            bytes_sent_total: counters(&registry, "bytes_sent_total", "Sample payload bytes (keys and fields) sent to clients, by dataset.", &["dataset"]),
            stream_wait_seconds_total: reg(
                &registry,
                prometheus::CounterVec::new(
                    Opts::new(
                        "stream_wait_seconds_total",
                        "Time streams waited for shard data (downloads, parsing) with nothing to send: the trainer starves.",
                    ),
                    &["dataset"],
                )
                .unwrap(),
            ),
            client_wait_seconds_total: reg(
                &registry,
                prometheus::CounterVec::new(
                    Opts::new(
                        "client_wait_seconds_total",
                        "Time streams waited for the client to take data that was ready: the trainer is the bottleneck.",
                    ),
                    &["dataset"],
                )
                .unwrap(),
            ),
            first_sample_seconds: reg(
                &registry,
                prometheus::HistogramVec::new(
                    HistogramOpts::new("first_sample_seconds", "From a stream's request to its first sample sent.")
                        .buckets(prometheus::exponential_buckets(0.001, 4.0, 10).unwrap()),
                    &["dataset"],
                )
                .unwrap(),
            ),
            store_request_seconds: reg(
                &registry,
                prometheus::HistogramVec::new(
                    HistogramOpts::new("store_request_seconds", "Object-store request latency to the response head, by kind.")
                        .buckets(prometheus::exponential_buckets(0.001, 4.0, 10).unwrap()),
                    &["kind"],
                )
                .unwrap(),
            ),
            build_info: reg(
                &registry,
                prometheus::IntGaugeVec::new(
                    Opts::new("build_info", "1, labelled with the running build's version."),
                    &["version"],
                )
                .unwrap(),
            ),
            process_cpu_seconds_total: reg(
                &registry,
                prometheus::Counter::new("process_cpu_seconds_total", "User and system CPU time the daemon has used.").unwrap(),
            ),
            process_resident_memory_bytes: gauge("process_resident_memory_bytes", "Resident memory of the daemon."),
            process_open_fds: gauge("process_open_fds", "Open file descriptors of the daemon."),
            shard_fetches_total: counter("shard_fetches_total", "Shards fetched (downloaded or mapped) successfully."),
            shard_fetch_errors_total: counter("shard_fetch_errors_total", "Shard fetches that failed."),
            shard_fetch_bytes_total: counter("shard_fetch_bytes_total", "Bytes of shards fetched."),
            shard_fetch_seconds: reg(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new("shard_fetch_seconds", "Time to fetch one shard.")
                        .buckets(prometheus::exponential_buckets(0.001, 4.0, 10).unwrap()),
                )
                .unwrap(),
            ),
            downloads_active: gauge("downloads_active", "Shard downloads in flight."),
            store_requests_total: counters(
                &registry,
                "store_requests_total",
                "Object-store HTTP requests, by kind (head, get: one per ranged part and per retry) and outcome (ok, throttled, unavailable, timeout, error).",
                &["kind", "outcome"],
            ),
            store_request_rate_limit: reg(
                &registry,
                prometheus::GaugeVec::new(
                    Opts::new("store_request_rate_limit", "Requests per second this host allows itself to the bucket, adapted to its 429s; 0: no limit."),
                    &["bucket"],
                )
                .unwrap(),
            ),
            store_wait_seconds_total: reg(
                &registry,
                prometheus::CounterVec::new(
                    Opts::new("store_wait_seconds_total", "Time requests a trainer waited for were held back by the store's pushback: the host's request rate (paced) or a retry's backoff (backoff)."),
                    &["reason"],
                )
                .unwrap(),
            ),
            store_bytes_total: counter("store_bytes_total", "Body bytes received from object stores."),
            store_errors_total: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new("store_errors_total", "Object-store request errors, by kind (not_found, changed, pushback: the store pushed back for store.retry_timeout, other)."),
                    &["kind"],
                )
                .unwrap(),
            ),
            cache_bytes: gauge("cache_bytes", "Bytes charged against cache.max_size: entries, downloads and decompression in progress."),
            cache_bytes_max: gauge("cache_bytes_max", "The most bytes charged against cache.max_size at once since the daemon started (its high-water mark)."),
            cache_capacity_bytes: gauge("cache_capacity_bytes", "cache.max_size."),
            cache_resident_bytes: gauge("cache_resident_bytes", "Bytes of complete cache entries on disk."),
            cache_pinned_bytes: gauge("cache_pinned_bytes", "Bytes of cache entries open streams are reading (never evicted)."),
            cache_hits_total: counter("cache_hits_total", "Shards a stream asked for that were ready in the cache."),
            cache_misses_total: counter("cache_misses_total", "Shards a stream asked for and had to wait for."),
            cache_evictions_total: counter("cache_evictions_total", "Cache entries evicted to make room."),
            cache_verify_failures_total: counter("cache_verify_failures_total", "Downloads or cache entries whose size or checksum did not verify."),
            cache_prefetched_bytes_total: counter("cache_prefetched_bytes_total", "Bytes fetched into the cache before any stream asked for them."),
            cache_full_total: counter("cache_full_total", "Shards a stream needed that found no cache space within cache.space_timeout (the stream failed with cache_full)."),
            stream_parks_total: counter("stream_parks_total", "Times a stream was parked: its client took no data for server.stall_timeout, so it released its shards until the client reads again."),
            zero_copy_maps: gauge("zero_copy_maps", "Shard files zero-copy clients hold mapped now (each pins its cache entry until released)."),
            zero_copy_mapped_bytes: gauge("zero_copy_mapped_bytes", "Bytes of the shard files zero-copy clients hold mapped now, per map (at most server.zero_copy_share of cache.max_size)."),
            sample_index_bytes: gauge("sample_index_bytes", "Memory the sample indexes of cached shards take (at most cache.index_memory)."),
            shards_parsed_total: counter("shards_parsed_total", "Shards whose tar was walked to find their samples: read first, or again after their index was dropped (cache.index_memory)."),
            mix_schedule_entry: reg(
                &registry,
                prometheus::IntGaugeVec::new(
                    Opts::new("mix_schedule_entry", "The schedule entry a mix's streams last sent a frame under: 0 for the mix's first weights, n for the schedule's n-th entry."),
                    &["dataset"],
                )
                .unwrap(),
            ),
            streams_parked: gauge("streams_parked", "Streams parked now (their clients paused; they hold no shards)."),
            gets_total: {
                let c = counters(&registry, "gets_total", "shardd get requests, by outcome: served, refused.", &["outcome"]);
                for outcome in ["served", "refused"] {
                    c.with_label_values(&[outcome]);
                }
                c
            },
            get_bytes_total: counter("get_bytes_total", "Bytes of the cache files handed to shardd get."),
            registry,
        }
    }

    /// Series that exist from the start (a dashboard's rate() needs the zero).
    pub fn init_dataset(&self, dataset: &str) {
        for outcome in ["completed", "failed", "cancelled"] {
            self.streams_total.with_label_values(&[dataset, outcome]);
        }
        self.samples_sent_total.with_label_values(&[dataset]);
        self.bytes_sent_total.with_label_values(&[dataset]);
        self.stream_wait_seconds_total.with_label_values(&[dataset]);
        self.client_wait_seconds_total.with_label_values(&[dataset]);
        self.first_sample_seconds.with_label_values(&[dataset]);
    }

    fn init_labels(&self) {
        self.build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        for kind in ["head", "get"] {
            for outcome in STORE_OUTCOMES {
                self.store_requests_total
                    .with_label_values(&[kind, outcome]);
            }
        }
        for reason in ["paced", "backoff"] {
            self.store_wait_seconds_total.with_label_values(&[reason]);
        }
        for kind in ["not_found", "changed", "pushback", "other"] {
            self.store_errors_total.with_label_values(&[kind]);
        }
    }

    /// GET requests sent to object stores, whatever their outcome.
    pub fn store_gets(&self) -> u64 {
        STORE_OUTCOMES
            .iter()
            .map(|o| {
                self.store_requests_total
                    .with_label_values(&["get", o])
                    .get()
            })
            .sum()
    }

    /// The text exposition format, for `/metrics`.
    pub fn render(&self) -> String {
        self.read_process();
        prometheus::TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .expect("text encoding cannot fail")
    }
}

impl Metrics {
    /// Process figures from /proc/self, read at scrape time.
    fn read_process(&self) {
        if let Ok(stat) = std::fs::read_to_string("/proc/self/stat")
            && let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r)
        {
            let fields: Vec<&str> = rest.split_whitespace().collect();
            // After the command: state is field 3, utime 14, stime 15, rss 24 (1-based).
            let at = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
            let ticks = rustix::param::clock_ticks_per_second() as f64;
            if let (Some(u), Some(s)) = (at(14), at(15)) {
                // A counter, brought up to what the kernel says.
                let now = (u + s) as f64 / ticks;
                let seen = self.process_cpu_seconds_total.get();
                self.process_cpu_seconds_total.inc_by((now - seen).max(0.0));
            }
            if let Some(pages) = at(24) {
                let page = rustix::param::page_size() as i64;
                self.process_resident_memory_bytes.set(pages as i64 * page);
            }
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            self.process_open_fds.set(fds.count() as i64);
        }
    }
}

/// A labelled counter family, registered.
fn counters(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).unwrap();
    registry
        .register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Counts one in-progress thing on a gauge for as long as it lives, so the gauge comes back
/// down on every path out (errors, cancellation, panics).
pub struct Active(prometheus::IntGauge);

impl Active {
    pub fn new(gauge: &prometheus::IntGauge) -> Active {
        gauge.inc();
        Active(gauge.clone())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.dec();
    }
}
