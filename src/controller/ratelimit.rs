//! A token bucket in front of our API requests: `--kube-api-qps` and `--kube-api-burst`.

use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

/// Client-side rate limit for API requests (watches excluded), like client-go's QPS/burst.
#[derive(Debug)]
pub struct RateLimiter {
    qps: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl RateLimiter {
    /// A bucket refilled at `qps` tokens per second holding at most `burst` (both > 0).
    pub fn new(qps: f64, burst: u32) -> RateLimiter {
        let burst = f64::from(burst.max(1));
        RateLimiter {
            qps: qps.max(0.001),
            burst,
            state: Mutex::new((burst, Instant::now())),
        }
    }

    /// Waits until a request may be sent.
    pub async fn acquire(&self) {
        let wait = {
            let mut state = self.state.lock().await;
            let (tokens, last) = &mut *state;
            let now = Instant::now();
            *tokens =
                (*tokens + now.duration_since(*last).as_secs_f64() * self.qps).min(self.burst);
            *last = now;
            *tokens -= 1.0;
            if *tokens >= 0.0 {
                Duration::ZERO
            } else {
                Duration::from_secs_f64(-*tokens / self.qps)
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn burst_then_steady_rate() {
        let limiter = RateLimiter::new(10.0, 5);
        let start = Instant::now();
        for _ in 0..5 {
            limiter.acquire().await;
        }
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "the burst goes through at once"
        );
        for _ in 0..10 {
            limiter.acquire().await;
        }
        let elapsed = start.elapsed().as_secs_f64();
        assert!(
            (0.99..=1.01).contains(&elapsed),
            "10 more at 10 qps take 1 s, took {elapsed}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn idle_time_refills_up_to_burst_only() {
        let limiter = RateLimiter::new(1.0, 2);
        limiter.acquire().await;
        limiter.acquire().await;
        tokio::time::advance(Duration::from_secs(100)).await;
        let start = Instant::now();
        limiter.acquire().await;
        limiter.acquire().await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        limiter.acquire().await;
        assert_eq!(start.elapsed(), Duration::from_secs(1));
    }
}
