//! delayd: a durable, millisecond-precise delay / scheduled-message service.
//!
//! Layers, bottom up: the storage engine (`schedulelog`, re-exported), the [`scheduler`] (loader, wheel,
//! dispatcher) and the [`sink`]s it delivers to.

#![forbid(unsafe_code)]

pub mod scheduler;
pub mod sink;

pub use schedulelog;
