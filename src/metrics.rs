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
    pub cache_bytes: IntGauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    pub fn new() -> Metrics {
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
            cache_bytes: gauge("cache_bytes", "Bytes of shard files the cache holds on disk."),
            registry,
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
