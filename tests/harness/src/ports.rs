//! Free loopback TCP ports for the control plane's listeners.

use std::collections::HashSet;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::Mutex;

use anyhow::Context;

/// Ports handed out by this process, so two control planes started in parallel by one test
/// binary never get the same one (the OS may offer a just-released port again).
static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// Returns a loopback port that was free a moment ago, by binding `127.0.0.1:0` and releasing it.
///
/// Another process can still take it before our child binds it; callers retry on
/// "address already in use".
pub(crate) fn free_loopback_port() -> anyhow::Result<u16> {
    let mut handed_out = HANDED_OUT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let handed_out = handed_out.get_or_insert_with(HashSet::new);
    for _ in 0..100 {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .context("binding 127.0.0.1:0 to find a free port")?;
        let port = listener
            .local_addr()
            .context("reading the bound port")?
            .port();
        if handed_out.insert(port) {
            return Ok(port);
        }
    }
    anyhow::bail!("no free loopback port found that this process has not already handed out")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_hands_out_a_port_twice() {
        let ports: HashSet<u16> = (0..20).map(|_| free_loopback_port().unwrap()).collect();
        assert_eq!(ports.len(), 20);
    }
}
