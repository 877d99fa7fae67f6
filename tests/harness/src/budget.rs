//! The fastest a client on a token-bucket budget could finish work that becomes ready over time:
//! the benchmarks' floor for deletes, which cannot start before kube-controller-manager releases
//! each PV.

use std::time::Duration;

/// When the last request could be sent by a client whose budget refills at `qps` and holds at
/// most `burst` (full at time zero), making `per_item` requests for each item, none before the
/// item is ready (`ready`: offsets from time zero, any order). Round trips are not counted: this
/// is a floor, not a model. With everything ready at zero it is the budget's own ceiling,
/// `(requests - burst) / qps`.
pub fn budget_floor(ready: &[Duration], per_item: f64, qps: f64, burst: f64) -> Duration {
    let mut ready: Vec<f64> = ready.iter().map(Duration::as_secs_f64).collect();
    ready.sort_by(f64::total_cmp);
    let (mut tokens, mut now) = (burst, 0.0_f64);
    // A fractional cost per item is spread so that the first `i` items cost `round(i * per)`.
    let mut sent = 0_u64;
    for (i, at) in ready.into_iter().enumerate() {
        let due = ((i + 1) as f64 * per_item).round() as u64;
        while sent < due {
            let start = at.max(now);
            tokens = (tokens + (start - now) * qps).min(burst);
            now = start;
            if tokens < 1.0 {
                now += (1.0 - tokens) / qps;
                tokens = 1.0;
            }
            tokens -= 1.0;
            sent += 1;
        }
    }
    Duration::from_secs_f64(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(values: &[f64]) -> Vec<Duration> {
        values
            .iter()
            .copied()
            .map(Duration::from_secs_f64)
            .collect()
    }

    fn floor(ready: &[f64], per: f64, qps: f64, burst: f64) -> f64 {
        budget_floor(&secs(ready), per, qps, burst).as_secs_f64()
    }

    #[test]
    fn everything_ready_at_once_is_the_budgets_ceiling() {
        // 500 deletes at two requests: (1000 - 200) / 100 s.
        let ready = vec![0.0; 500];
        assert!((floor(&ready, 2.0, 100.0, 200.0) - 8.0).abs() < 1e-9);
        // Within the burst nothing waits.
        assert_eq!(floor(&ready[..100], 2.0, 100.0, 200.0), 0.0);
    }

    #[test]
    fn work_ready_slower_than_the_budget_ends_when_the_last_item_is_ready() {
        // One item a second, one request each, ten a second allowed.
        let ready: Vec<f64> = (0..10).map(f64::from).collect();
        assert_eq!(floor(&ready, 1.0, 10.0, 1.0), 9.0);
    }

    #[test]
    fn a_burst_unused_while_nothing_is_ready_is_lost() {
        // The bucket holds at most `burst`: waiting 5 s does not save 50 tokens.
        let ready = vec![5.0; 30];
        assert!((floor(&ready, 1.0, 10.0, 10.0) - 7.0).abs() < 1e-9);
    }

    #[test]
    fn releases_faster_than_the_budget_pay_for_the_difference_at_the_end() {
        // 500 items over 7.5 s at two requests each: 1000 requests, the bucket (200 + 100/s)
        // runs dry before the last item, so the floor is the budget's ceiling, 8.0 s.
        let ready: Vec<f64> = (0..500).map(|i| f64::from(i) * 0.015).collect();
        assert!((floor(&ready, 2.0, 100.0, 200.0) - 8.0).abs() < 0.02);
        // At one request each the releases are the bound (7.485 s).
        assert!((floor(&ready, 1.0, 100.0, 200.0) - 7.485).abs() < 1e-9);
    }

    #[test]
    fn a_fractional_cost_is_spread_over_the_items() {
        // 1.5 requests an item over 4 items: 6 requests, one token a second, none saved.
        let ready = vec![0.0; 4];
        assert!((floor(&ready, 1.5, 1.0, 1.0) - 5.0).abs() < 1e-9);
        assert_eq!(floor(&[], 2.0, 1.0, 1.0), 0.0);
    }
}
