//! Sandbox networking (issue 18). Today: ports, a server inside a sandbox reached from the host
//! ([`ports`]), in every network mode.

pub mod ports;
