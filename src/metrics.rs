//! Prometheus metrics, in a registry owned by the daemon. Base units, counters end in
//! `_total`, and no label has per-sample or per-shard cardinality.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

pub struct Metrics {
    pub registry: Registry,
    pub connections_active: IntGauge,
    pub connections_total: IntCounter,
    pub connections_rejected_total: IntCounter,
    pub streams_active: IntGauge,
    /// Ended streams by outcome: completed, failed, cancelled (client left or shutdown).
    pub streams_total: IntCounterVec,
    pub samples_sent_total: IntCounter,
    pub bytes_sent_total: IntCounter,
    /// Time streams spent waiting for shard data with nothing to send: starvation.
    pub stream_wait_seconds_total: prometheus::Counter,
    pub shard_fetches_total: IntCounter,
    pub shard_fetch_errors_total: IntCounter,
    pub shard_fetch_bytes_total: IntCounter,
    pub shard_fetch_seconds: Histogram,
    pub downloads_active: IntGauge,
    /// Object-store requests by kind (head, get: one per ranged part).
    pub store_requests_total: IntCounterVec,
    /// Body bytes received from object stores.
    pub store_bytes_total: IntCounter,
    /// Object-store errors by kind (not_found, changed, other).
    pub store_errors_total: IntCounterVec,
    /// Bytes the cache charges against `cache.max_size`: entries plus reservations.
    pub cache_bytes: IntGauge,
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
    /// Streams ended because their client read nothing for `server.stall_timeout`.
    pub streams_stalled_total: IntCounter,
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
            streams_total: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new("streams_total", "Streams ended, by outcome."),
                    &["outcome"],
                )
                .unwrap(),
            ),
            samples_sent_total: counter("samples_sent_total", "Samples sent to clients."),
            bytes_sent_total: counter("bytes_sent_total", "Sample payload bytes (keys and fields) sent to clients."),
            stream_wait_seconds_total: reg(
                &registry,
                prometheus::Counter::new(
                    "stream_wait_seconds_total",
                    "Time streams spent waiting for shard data (downloads, parsing) with nothing to send.",
                )
                .unwrap(),
            ),
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
            store_requests_total: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new("store_requests_total", "Object-store requests, by kind (head, get; one get per ranged part)."),
                    &["kind"],
                )
                .unwrap(),
            ),
            store_bytes_total: counter("store_bytes_total", "Body bytes received from object stores."),
            store_errors_total: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new("store_errors_total", "Object-store request errors, by kind (not_found, changed, other)."),
                    &["kind"],
                )
                .unwrap(),
            ),
            cache_bytes: gauge("cache_bytes", "Bytes charged against cache.max_size: entries, downloads and decompression in progress."),
            cache_capacity_bytes: gauge("cache_capacity_bytes", "cache.max_size."),
            cache_resident_bytes: gauge("cache_resident_bytes", "Bytes of complete cache entries on disk."),
            cache_pinned_bytes: gauge("cache_pinned_bytes", "Bytes of cache entries open streams are reading (never evicted)."),
            cache_hits_total: counter("cache_hits_total", "Shards a stream asked for that were ready in the cache."),
            cache_misses_total: counter("cache_misses_total", "Shards a stream asked for and had to wait for."),
            cache_evictions_total: counter("cache_evictions_total", "Cache entries evicted to make room."),
            cache_verify_failures_total: counter("cache_verify_failures_total", "Downloads or cache entries whose size or checksum did not verify."),
            cache_prefetched_bytes_total: counter("cache_prefetched_bytes_total", "Bytes fetched into the cache before any stream asked for them."),
            streams_stalled_total: counter("streams_stalled_total", "Streams ended because the client read nothing for server.stall_timeout."),
            registry,
        }
    }

    /// Series that exist from the start (a dashboard's rate() needs the zero).
    fn init_labels(&self) {
        for kind in ["head", "get"] {
            self.store_requests_total.with_label_values(&[kind]);
        }
        for kind in ["not_found", "changed", "other"] {
            self.store_errors_total.with_label_values(&[kind]);
        }
        for outcome in ["completed", "failed", "cancelled"] {
            self.streams_total.with_label_values(&[outcome]);
        }
    }

    /// The text exposition format, for `/metrics`.
    pub fn render(&self) -> String {
        prometheus::TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .expect("text encoding cannot fail")
    }
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
