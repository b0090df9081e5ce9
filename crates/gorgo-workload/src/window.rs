//! Cutting a time window out of a trace (`gorgo trace convert --window-start
//! --duration`), the way ART-Chat-2.5M's published statistics are per 30-minute window,
//! and the one selection of the requests a run replays ([`select_requests`]: `gorgo
//! bench`, `compare`, `sim` and `sweep`).

use std::path::Path;

use crate::record::TraceRequest;
use crate::Result;

/// The requests a run replays from the trace at `path`: those with a timestamp before
/// `window_s` seconds of trace time (every one when `None`), in arrival order (a
/// stable sort by timestamp: a row out of order in the file takes its place), the
/// first `max_requests` of them. `gorgo bench` and `gorgo compare` replay this
/// selection live and `gorgo sim` and `gorgo sweep` simulate it, so the same flags
/// select the same requests on both sides. A malformed row is an error naming its
/// line, before any request is yielded.
///
/// A trace whose selected rows are in time order (every trace this project ships) is
/// read twice: once to check that, then streamed, so memory does not grow with the
/// trace's length (the simulator's promise, docs/simulator.md). One out of order is
/// read into memory and its selected rows sorted.
pub fn select_requests(
    path: &Path,
    window_s: Option<f64>,
    max_requests: Option<u64>,
) -> Result<Box<dyn Iterator<Item = Result<TraceRequest>> + Send>> {
    let limit_ms = window_s.map(|w| w * 1000.0);
    let selected = move |r: &TraceRequest| limit_ms.is_none_or(|l| (r.timestamp_ms as f64) < l);
    let max = max_requests.map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX));
    let in_memory = |rows: Box<dyn Iterator<Item = Result<TraceRequest>>>| {
        let mut rows = rows
            .filter(|row| row.as_ref().map_or(true, selected))
            .collect::<Result<Vec<_>>>()?;
        rows.sort_by_key(|r| r.timestamp_ms);
        rows.truncate(max);
        Ok::<_, crate::WorkloadError>(Box::new(rows.into_iter().map(Ok)) as Box<_>)
    };
    // A pipe or other stream (`--trace <(zcat t.gz)`) can be read only once: into memory.
    if !std::fs::metadata(path)?.is_file() {
        return in_memory(Box::new(crate::open_trace(path)?));
    }
    // First pass: are the selected rows in time order, and which row is the last one?
    let mut last: Option<u64> = None;
    let mut last_row = 0usize;
    let mut sorted = true;
    for (i, row) in crate::open_trace(path)?.enumerate() {
        let r = row?;
        if selected(&r) {
            sorted &= last.is_none_or(|t| t <= r.timestamp_ms);
            last = Some(r.timestamp_ms);
            last_row = i;
        }
    }
    let reader = crate::open_trace(path)?;
    if sorted {
        // Rows past the last selected one are not read again.
        return Ok(Box::new(
            reader
                .take(last_row + 1)
                .filter(move |row| row.as_ref().map_or(true, selected))
                .take(max),
        ));
    }
    in_memory(Box::new(reader))
}

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

    fn trace(dir: &Path, timestamps: &[u64]) -> std::path::PathBuf {
        let path = dir.join("t.jsonl");
        let rows: Vec<String> = timestamps
            .iter()
            .enumerate()
            .map(|(i, t)| {
                format!(
                    r#"{{"timestamp": {t}, "input_length": {}, "output_length": 1, "hash_ids": [{i}]}}"#,
                    100 + i
                )
            })
            .collect();
        std::fs::write(&path, rows.join("\n") + "\n").unwrap();
        path
    }

    fn selection(path: &Path, window_s: Option<f64>, max: Option<u64>) -> Vec<u64> {
        select_requests(path, window_s, max)
            .unwrap()
            .map(|r| r.unwrap().timestamp_ms)
            .collect()
    }

    /// In time order or not, the selection is the rows before the window's end, sorted
    /// (ties in file order), the first `max_requests` of them; a row far past the
    /// window's end that belongs in it is found.
    #[test]
    fn the_selection_is_the_windows_rows_in_arrival_order() {
        let dir = tempfile::tempdir().unwrap();
        let sorted = trace(dir.path(), &[0, 500, 1000, 1000, 2500, 4000]);
        assert_eq!(
            selection(&sorted, None, None),
            [0, 500, 1000, 1000, 2500, 4000]
        );
        assert_eq!(selection(&sorted, Some(2.5), None), [0, 500, 1000, 1000]);
        assert_eq!(selection(&sorted, Some(2.5), Some(3)), [0, 500, 1000]);

        let mut late: Vec<u64> = vec![3000, 200, 100];
        late.extend((0..2000).map(|i| 10_000 + i));
        late.push(50);
        let unsorted = trace(dir.path(), &late);
        assert_eq!(selection(&unsorted, Some(5.0), None), [50, 100, 200, 3000]);
        assert_eq!(selection(&unsorted, Some(5.0), Some(2)), [50, 100]);
        let all = selection(&unsorted, None, Some(3));
        assert_eq!(all, [50, 100, 200]);
        // Equal timestamps keep their file order: the rows' lengths tell them apart.
        let ties = trace(dir.path(), &[7, 3, 7, 3]);
        let inputs: Vec<u64> = select_requests(&ties, None, None)
            .unwrap()
            .map(|r| r.unwrap().input_tokens)
            .collect();
        assert_eq!(inputs, [101, 103, 100, 102]);
    }

    /// A trace read from a pipe (`--trace <(zcat t.gz)`) can be read once only: its
    /// selection is the same as the file's.
    #[cfg(unix)]
    #[test]
    fn a_trace_from_a_pipe_is_selected_as_its_file_is() {
        let dir = tempfile::tempdir().unwrap();
        let file = trace(dir.path(), &[0, 500, 1000, 4000]);
        let fifo = dir.path().join("pipe.jsonl");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            return;
        }
        let (from, to) = (file.clone(), fifo.clone());
        let writer = std::thread::spawn(move || std::fs::copy(from, to).unwrap());
        assert_eq!(selection(&fifo, Some(2.0), None), [0, 500, 1000]);
        writer.join().unwrap();
    }

    /// A malformed row stops the selection with its line number, before anything is
    /// yielded.
    #[test]
    fn a_malformed_row_is_an_error_naming_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.jsonl");
        std::fs::write(
            &path,
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": []}\nnot json\n",
        )
        .unwrap();
        let err = select_requests(&path, None, None)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("line 2"), "{err}");
    }

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
