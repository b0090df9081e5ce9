//! Benchmark and simulation reports: the results.json schema, the Markdown table, requests.csv and SVG plots.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
