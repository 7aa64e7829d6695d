//! `eccl-bench --plot FILE` (this run's table as a picture) and `eccl-bench plot FILE
//! RESULT.json...` (several runs' `--json` results in one picture: eccl over each
//! transport and gloo side by side). Two panels over the message size: bus bandwidth and
//! time, both on log axes.

use std::path::Path;
use std::process::ExitCode;

use eccl_plot::{Axis, Figure, Panel, Scale, Series, Style, Units};
use serde::{Deserialize, Serialize};

/// A run's results: what `--json` writes and the picture reads (also in the shape another
/// benchmark writes: `examples/compare_gloo.py` writes gloo's so, without the fields
/// that have defaults here).
#[derive(Serialize, Deserialize)]
pub struct Report {
    pub collective: String,
    pub world_size: u32,
    #[serde(default)]
    pub dtype: String,
    #[serde(default)]
    pub op: String,
    pub transport: String,
    /// `int8` or `fp8` with --quantize.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize: Option<String>,
    /// The series' name, where the transport alone is not it (`gloo`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    pub rows: Vec<Row>,
}

#[derive(Serialize, Deserialize)]
pub struct Row {
    pub dtype: String,
    pub op: String,
    pub bytes: usize,
    #[serde(default)]
    pub count: usize,
    pub time_us: f64,
    #[serde(default)]
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    #[serde(default)]
    pub wrong: u64,
}

/// One series per result and (dtype, op) pair, named by the label (or `eccl`, the
/// transport and the quantization), with the pair where a result has several.
pub fn figure(results: &[Report]) -> Figure {
    let mut bw = Vec::new();
    let mut time = Vec::new();
    for r in results {
        let name = r.label.clone().unwrap_or_else(|| match &r.quantize {
            Some(q) => format!("eccl {} {q}", r.transport),
            None => format!("eccl {}", r.transport),
        });
        let mut pairs: Vec<(&str, &str)> = r
            .rows
            .iter()
            .map(|w| (w.dtype.as_str(), w.op.as_str()))
            .collect();
        pairs.dedup();
        let several = pairs.len() > 1;
        for (dtype, op) in pairs {
            let rows = r.rows.iter().filter(|w| w.dtype == dtype && w.op == op);
            let label = if several {
                format!("{name} {dtype} {op}")
            } else {
                name.clone()
            };
            let series = |f: fn(&Row) -> f64| Series {
                label: label.clone(),
                points: rows.clone().map(|w| (w.bytes as f64, f(w))).collect(),
                style: Style::Line,
            };
            bw.push(series(|w| w.busbw_gbps));
            time.push(series(|w| w.time_us));
        }
    }
    let mut shapes: Vec<(&str, u32)> = results
        .iter()
        .map(|r| (r.collective.as_str(), r.world_size))
        .collect();
    shapes.sort();
    shapes.dedup();
    let title = match shapes.as_slice() {
        [(c, n)] => format!("{c}, {n} ranks"),
        _ => shapes
            .iter()
            .map(|(c, n)| format!("{c} ({n} ranks)"))
            .collect::<Vec<_>>()
            .join(", "),
    };
    Figure {
        title,
        x: Axis::new("message size", Scale::Log2, Units::Bytes),
        panels: vec![
            Panel {
                y: Axis::new("bus bandwidth (GB/s)", Scale::Log10, Units::Plain),
                series: bw,
            },
            Panel {
                y: Axis::new("time (us)", Scale::Log10, Units::Plain),
                series: time,
            },
        ],
        markers: Vec::new(),
        spans: Vec::new(),
        size: (900, 820),
    }
}

/// `eccl-bench plot OUT.svg RESULT.json...`
pub fn main(args: &[String]) -> ExitCode {
    let usage = "usage: eccl-bench plot OUT.svg RESULT.json... (results of eccl-bench --json, or of examples/compare_gloo.py)";
    let [out, inputs @ ..] = args else {
        eprintln!("eccl-bench: {usage}");
        return ExitCode::from(2);
    };
    if inputs.is_empty() || out.starts_with('-') {
        eprintln!("eccl-bench: {usage}");
        return ExitCode::from(2);
    }
    let mut results = Vec::new();
    for path in inputs {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("eccl-bench: cannot read {path}: {e}");
                return ExitCode::FAILURE;
            }
        };
        match serde_json::from_str::<Report>(&text) {
            Ok(r) => results.push(r),
            Err(e) => {
                eprintln!("eccl-bench: {path} is not an eccl-bench --json result: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    match figure(&results).write_svg(Path::new(out)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("eccl-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
