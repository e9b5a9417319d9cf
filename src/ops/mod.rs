//! What running the daemon on a fleet needs, beside the data path.

pub mod error_line;
pub mod malloc;
pub mod metrics;
pub mod progress;
pub mod systemd;
