//! Cutting a time window out of a trace (`gorgo trace convert --window-start
//! --duration`), the way ART-Chat-2.5M's published statistics are per 30-minute window.

use crate::record::TraceRequest;
use crate::Result;

/// Keep the requests arriving in `[start_ms, start_ms + duration_ms)` (no end when
/// `duration_ms` is `None`) and rebase their timestamps to `start_ms`. Errors pass
/// through untouched so the caller still sees line numbers.
pub fn slice_window<I>(
    requests: I,
    start_ms: u64,
    duration_ms: Option<u64>,
) -> impl Iterator<Item = Result<TraceRequest>>
where
    I: IntoIterator<Item = Result<TraceRequest>>,
{
    let end_ms = duration_ms.map(|d| start_ms.saturating_add(d));
    requests.into_iter().filter_map(move |r| match r {
        Ok(mut req) => {
            let t = req.timestamp_ms;
            if t < start_ms || end_ms.is_some_and(|end| t >= end) {
                return None;
            }
            req.timestamp_ms = t - start_ms;
            Some(Ok(req))
        }
        Err(e) => Some(Err(e)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t: u64) -> Result<TraceRequest> {
        Ok(TraceRequest::at_ms(t))
    }

    #[test]
    fn window_keeps_half_open_interval_and_rebases() {
        let kept: Vec<u64> = slice_window((0..10).map(|i| at(i * 100)), 200, Some(300))
            .map(|r| r.unwrap().timestamp_ms)
            .collect();
        assert_eq!(kept, vec![0, 100, 200]);
        let open: Vec<u64> = slice_window((0..4).map(|i| at(i * 100)), 250, None)
            .map(|r| r.unwrap().timestamp_ms)
            .collect();
        assert_eq!(open, vec![50]);
    }
}
