//! The HTTP client under every object store: each request to the bucket is paced
//! ([`super::pacing`]), retried while the store pushes back ([`super::retry`]), counted by
//! outcome, and its response's checksum headers read ([`super::reported`]).
//!
//! object_store's own retries are off (`max_retries = 0`): they count attempts, which a
//! burst of 429s spends in two seconds, and they would retry behind the pacer's back.
//! Retrying here, below object_store, means every attempt takes a token from the host's
//! rate, and object_store sees one answer: the first final one, or a [`GaveUp`] once the
//! store has pushed back for `store.retry_timeout`. A retry carries the bucket's current
//! token, not the one the request was signed with (`resign.rs`). A body cut mid-way is
//! resumed by the download (`download.rs`), under the same policy.
//!
//! Token requests (the metadata server, OAuth) go through this client too, since
//! object_store builds its credential clients from the same connector: they are retried, but
//! neither paced nor counted, as they are not the bucket's. A request is the bucket's when
//! its URL names the bucket: in its path (GCS, path-style S3) or its host (virtual-hosted S3).

use std::sync::Arc;
use std::time::Duration;

use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse, HttpService,
    ReqwestConnector,
};

use super::credentials::one_line;
use super::notice::Notice;
use super::pacing::{Pacer, Urgency};
use super::reported::{Kind, Reported};
use super::resign::Resigner;
use super::retry::{GaveUp, Outcome, Retries};
use crate::ops::metrics::Metrics;

/// Builds the clients of one bucket's store.
#[derive(Debug, Clone)]
pub(super) struct Connector {
    pub kind: Kind,
    /// The bucket's name, as its requests' URLs hold it...
    pub bucket: String,
    /// ...and as metrics name it: `gs://bucket`.
    pub label: String,
    pub pacer: Arc<Pacer>,
    /// `store.retry_timeout` (zero when `store.retries = 0`).
    pub retry_timeout: Duration,
    /// At most this many retries too: the credentials probe's (`build.rs`).
    pub most_retries: Option<u32>,
    /// Renews a retried request's token ([`super::resign`]).
    pub resign: Resigner,
    /// Warns that the bucket pushes back, now and then ([`super::notice`]).
    pub notice: Arc<Notice>,
    pub metrics: Arc<Metrics>,
}

impl HttpConnector for Connector {
    fn connect(&self, options: &object_store::ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(Client {
            connector: self.clone(),
            inner,
        }))
    }
}

#[derive(Debug)]
struct Client {
    connector: Connector,
    inner: HttpClient,
}

impl std::fmt::Debug for Pacer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Pacer").field(&self.snapshot()).finish()
    }
}

#[async_trait::async_trait]
impl HttpService for Client {
    async fn call(&self, request: HttpRequest) -> Result<HttpResponse, HttpError> {
        let c = &self.connector;
        let bucket = c.is_bucket(&request);
        let kind = match request.method().as_str() {
            "HEAD" => "head",
            "GET" => "get",
            _ => "other",
        };
        let urgency = Urgency::current();
        let mut retries = Retries::new(c.retry_timeout);
        if let Some(most) = c.most_retries {
            retries = retries.at_most(most);
        }
        let mut request = request;
        loop {
            if bucket {
                if retries.failures() > 0 {
                    c.resign.refresh(&mut request).await;
                }
                let paced = c.pacer.acquire(&urgency).await;
                c.waited(&urgency, "paced", paced);
            }
            let sent = tokio::time::Instant::now();
            let result = self.inner.execute(copy(&request)).await;
            let outcome = match &result {
                Ok(response) => Outcome::of_status(response.status().as_u16()),
                Err(e) => Outcome::of_transport(e),
            };
            if bucket {
                c.pacer.record(outcome, sent);
                c.metrics
                    .store_request_rate_limit
                    .with_label_values(&[&c.label])
                    .set(c.pacer.snapshot().rate.unwrap_or(0.0));
                c.metrics
                    .store_requests_total
                    .with_label_values(&[kind, outcome.label()])
                    .inc();
            }
            if outcome == Outcome::Ok {
                let mut response = result?;
                let reported = Reported::from_headers(c.kind, response.headers());
                if reported != Reported::default() {
                    response.extensions_mut().insert(reported);
                }
                return Ok(response);
            }
            let cause = describe(&result);
            let Some(wait) = retries.failed(outcome) else {
                if !outcome.is_pushback() || !bucket {
                    // The request's own answer, or a token request's (the credential
                    // source's words): object_store says what it is.
                    return result;
                }
                let kind = match &result {
                    Err(e) => e.kind(),
                    Ok(_) => HttpErrorKind::Unknown,
                };
                return Err(HttpError::new(
                    kind,
                    GaveUp {
                        cause,
                        waited: retries.waited(),
                        attempts: retries.failures(),
                        timeout: c.retry_timeout,
                    },
                ));
            };
            tracing::debug!(
                url = %request.uri(), cause, failures = retries.failures(), wait = ?wait,
                "the store pushed back: retrying"
            );
            if bucket {
                c.notice.pushed_back(&c.label, &cause, c.retry_timeout);
            }
            tokio::time::sleep(wait).await;
            c.waited(&urgency, "backoff", wait);
        }
    }
}

impl Connector {
    /// Whether the request is to this bucket (not for a token).
    fn is_bucket(&self, request: &HttpRequest) -> bool {
        let uri = request.uri();
        let path = uri.path();
        let b = self.bucket.as_str();
        uri.host().is_some_and(|h| h.starts_with(&format!("{b}.")))
            || path.ends_with(&format!("/{b}"))
            || path.contains(&format!("/{b}/"))
    }

    fn waited(&self, urgency: &Urgency, reason: &str, time: Duration) {
        if urgency.is_urgent() && !time.is_zero() {
            self.metrics
                .store_wait_seconds_total
                .with_label_values(&[reason])
                .inc_by(time.as_secs_f64());
        }
    }
}

/// What an attempt met, in words: "answered 429 Too Many Requests", "timed out: …".
fn describe(result: &Result<HttpResponse, HttpError>) -> String {
    match result {
        Ok(response) => format!("answered {}", response.status()),
        Err(e) => match Outcome::of_transport(e) {
            Outcome::Timeout => format!("timed out ({})", one_line(e)),
            _ => format!("could not be reached ({})", one_line(e)),
        },
    }
}

/// A request to send again: GETs and HEADs have empty bodies, and a PUT's body is bytes
/// (object_store sends no streaming bodies), so a copy is cheap.
fn copy(request: &HttpRequest) -> HttpRequest {
    let mut copy = HttpRequest::new(request.body().clone());
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    copy
}
