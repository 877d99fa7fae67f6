//! Polling until a condition holds, with a deadline and an error that says what was awaited.

use std::time::Duration;

use anyhow::bail;

/// How often [`wait_for`] re-runs its check.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Polls `check` every 100 ms until it returns `Ok(Some(v))` or `timeout` passes; the error names
/// `what`.
///
/// `Ok(None)` means "not yet". An `Err` also means "not yet" (the API server may be restarting),
/// but the last one is kept and reported if the deadline passes. Uses tokio's clock, so it works
/// under paused time.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error = None;
    loop {
        match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(error) => last_error = Some(error),
        }
        if tokio::time::Instant::now() >= deadline {
            match last_error {
                Some(error) => {
                    bail!("timed out after {timeout:?} waiting for {what}; last error: {error:#}")
                }
                None => bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn returns_the_first_ready_value() {
        let mut calls = 0;
        let value = wait_for("third call", Duration::from_secs(5), || {
            calls += 1;
            let ready = calls == 3;
            async move { Ok(ready.then_some(42)) }
        })
        .await
        .unwrap();
        assert_eq!(value, 42);
        assert_eq!(calls, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn timeout_names_what_and_the_last_error() {
        let error = wait_for::<(), _, _>("the moon", Duration::from_secs(1), || async {
            Err(anyhow::anyhow!("cloudy"))
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(error.contains("the moon"), "{error}");
        assert!(error.contains("cloudy"), "{error}");
    }
}
