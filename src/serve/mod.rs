//! Serving: the daemon's wiring, the socket, a stream per connection and what feeds it.

pub mod daemon;
pub mod get;
pub mod http;
pub mod learned_host;
pub mod mapped;
pub mod prefetch;
pub mod server;
pub mod sink;
pub mod status;
pub mod stream;
