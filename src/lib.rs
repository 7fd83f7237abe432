//! delayd: a durable, millisecond-precise delay / scheduled-message service.
//!
//! So far the package holds the storage engine, re-exported from the `schedulelog` crate; the scheduler,
//! sinks and HTTP service build on it.

#![forbid(unsafe_code)]

pub use schedulelog;
