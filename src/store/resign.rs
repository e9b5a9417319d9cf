//! A retried request carries a token that is still good.
//!
//! object_store signs a request once; our client then sends it again while the store pushes
//! back (`http.rs`), for up to `store.retry_timeout`. The token it was signed with can expire
//! in that time: object_store renews a GCS token only when it has under 5 minutes left, so a
//! `retry_timeout` longer than that, or a credential source handing out tokens that live less
//! (a workload identity, a test's), would send the retries after an outage with an expired
//! token, and the store's 401 would fail a stream the outage itself did not. So before each
//! retry of a GCS request its bearer token is asked anew of the store's own credential
//! provider: that is free while the cached token is good, and fetches one when it is due.
//!
//! S3 requests are not re-signed: a SigV4 signature holds its time and is good for 15
//! minutes, longer than the default `retry_timeout` (docs/configuration.md says so).

use std::sync::{Arc, OnceLock};

use object_store::client::HttpRequest;
use object_store::gcp::GcpCredentialProvider;
use reqwest::header::{AUTHORIZATION, HeaderValue};

/// The credential provider of one GCS store, once it is built (its client is built first,
/// from the connector that holds this).
#[derive(Debug, Clone, Default)]
pub(super) struct Resigner(Arc<OnceLock<GcpCredentialProvider>>);

impl Resigner {
    /// Set once the store is built; a second call changes nothing.
    pub fn set(&self, provider: GcpCredentialProvider) {
        let _ = self.0.set(provider);
    }

    /// Puts the provider's current token in a bearer-signed `request`. A request that is not
    /// signed (anonymous, S3), or a provider that cannot answer now, leaves it as it was: the
    /// store then says what it thinks of the old token.
    pub async fn refresh(&self, request: &mut HttpRequest) {
        let Some(provider) = self.0.get() else {
            return;
        };
        let signed = request
            .headers()
            .get(AUTHORIZATION)
            .is_some_and(|v| v.as_bytes().starts_with(b"Bearer "));
        if !signed {
            return;
        }
        match provider.get_credential().await {
            Ok(credential) => {
                if let Ok(mut value) =
                    HeaderValue::from_str(&format!("Bearer {}", credential.bearer))
                {
                    value.set_sensitive(true);
                    request.headers_mut().insert(AUTHORIZATION, value);
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "no new token for a retried request: it keeps its own");
            }
        }
    }
}
