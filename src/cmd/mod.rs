//! The commands other than `serve`: each runs the stages below it once and exits.

pub mod check;
pub mod demo;
pub mod get;
pub mod index;
pub mod plan_report;
pub mod units;
pub mod warm;
