//! The pictures eccl's tools draw (`eccl-bench --plot`, `eccl-chaos --plot`): SVG files
//! made with [plotters], one or more panels stacked over a shared x axis.
//!
//! A tool describes what to draw as data ([`Figure`]: panels of series, markers and
//! spans on the x axis) and [`Figure::write_svg`] draws it. Logarithmic axes are drawn
//! in log space with labels in the data's units (byte sizes as `4 KiB`, `64 MiB`), so
//! every panel has the same coordinate type whatever its scales.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

/// Why a picture could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The file name does not end in `.svg`, the one format drawn.
    #[error("{0}: eccl draws SVG pictures; name the file *.svg")]
    NotSvg(String),
    /// Nothing to draw: no panel has a point that fits its axes.
    #[error("nothing to draw in {0}: {1}")]
    Empty(String, String),
    /// plotters or the file system refused (the file could not be written, say).
    #[error("cannot draw {0}: {1}")]
    Draw(String, String),
}

/// How an axis maps values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    Linear,
    /// Base-10 logarithm; values at or below zero are left out.
    Log10,
    /// Base-2 logarithm (byte sizes); values at or below zero are left out.
    Log2,
}

impl Scale {
    fn axis_of(self, v: f64) -> Option<f64> {
        let a = match self {
            Scale::Linear => v,
            _ if v <= 0.0 => return None,
            Scale::Log10 => v.log10(),
            Scale::Log2 => v.log2(),
        };
        a.is_finite().then_some(a)
    }

    fn value_at(self, a: f64) -> f64 {
        match self {
            Scale::Linear => a,
            Scale::Log10 => 10f64.powf(a),
            Scale::Log2 => a.exp2(),
        }
    }
}

/// How an axis's tick labels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Units {
    /// A number (`0.25`, `12`, `3.5e6`).
    Plain,
    /// Bytes, in powers of 1024 (`512 B`, `4 KiB`, `1 GiB`).
    Bytes,
    /// A count (members): whole numbers only, no label between them.
    Count,
}

/// One axis: its label, scale and units.
#[derive(Clone, Debug)]
pub struct Axis {
    pub label: String,
    pub scale: Scale,
    pub units: Units,
}

impl Axis {
    pub fn new(label: impl Into<String>, scale: Scale, units: Units) -> Axis {
        Axis {
            label: label.into(),
            scale,
            units,
        }
    }

    fn tick(&self, a: f64) -> String {
        let v = self.scale.value_at(a);
        match self.units {
            Units::Bytes => bytes(v),
            Units::Plain => number(v),
            Units::Count if (v - v.round()).abs() < 1e-9 => number(v.round()),
            Units::Count => String::new(),
        }
    }
}

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// Points joined by straight lines, each point marked.
    Line,
    /// A staircase: each value holds until the next point (members of a world).
    Steps,
}

/// One named line of a panel.
#[derive(Clone, Debug)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    pub style: Style,
}

/// A vertical line across every panel at `x`, with a short label (a fault, a leader
/// change). Markers of one `kind` share a colour and one legend entry.
#[derive(Clone, Debug)]
pub struct Marker {
    pub x: f64,
    pub kind: String,
    pub label: String,
}

/// A stretch of the x axis shaded across every panel (a fault's abort or recovery).
/// Spans of one `kind` share a colour and one legend entry.
#[derive(Clone, Debug)]
pub struct Span {
    pub from: f64,
    pub to: f64,
    pub kind: String,
}

/// One chart: a y axis and its series, over the figure's x axis.
#[derive(Clone, Debug)]
pub struct Panel {
    pub y: Axis,
    pub series: Vec<Series>,
}

/// A picture: a title, one x axis, panels stacked top to bottom, and markers and spans
/// drawn across all of them.
#[derive(Clone, Debug)]
pub struct Figure {
    pub title: String,
    pub x: Axis,
    pub panels: Vec<Panel>,
    pub markers: Vec<Marker>,
    pub spans: Vec<Span>,
    /// Width and height in pixels.
    pub size: (u32, u32),
}

/// The colours of series, markers and spans, in order of first appearance.
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// The distinct values of `kinds`, in order of first appearance.
fn kinds<'a>(kinds: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for k in kinds {
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

/// The axis range of `values`: min and max, widened a little (and around a single value)
/// so that nothing sits on the frame.
fn range(values: impl Iterator<Item = f64>, scale: Scale) -> Option<(f64, f64)> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() || !hi.is_finite() {
        return None;
    }
    let pad = if hi > lo {
        (hi - lo) * 0.04
    } else if scale == Scale::Linear {
        lo.abs().max(1.0) * 0.5
    } else {
        0.5
    };
    Some((lo - pad, hi + pad))
}

impl Figure {
    /// The panels' series mapped to axis space, points off the axes left out.
    fn mapped(&self) -> Vec<Vec<(usize, Vec<(f64, f64)>)>> {
        self.panels
            .iter()
            .map(|p| {
                p.series
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let pts = s
                            .points
                            .iter()
                            .filter_map(|&(x, y)| {
                                Some((self.x.scale.axis_of(x)?, p.y.scale.axis_of(y)?))
                            })
                            .collect();
                        (i, pts)
                    })
                    .collect()
            })
            .collect()
    }

    /// Draws the figure into an SVG file at `path`.
    pub fn write_svg(&self, path: &Path) -> Result<(), PlotError> {
        let name = path.display().to_string();
        if path.extension().and_then(|e| e.to_str()) != Some("svg") {
            return Err(PlotError::NotSvg(name));
        }
        let mapped = self.mapped();
        let xs = mapped
            .iter()
            .flatten()
            .flat_map(|(_, pts)| pts.iter().map(|p| p.0))
            .chain(
                self.markers
                    .iter()
                    .filter_map(|m| self.x.scale.axis_of(m.x)),
            )
            .chain(
                self.spans
                    .iter()
                    .flat_map(|s| [s.from, s.to])
                    .filter_map(|v| self.x.scale.axis_of(v)),
            );
        let Some(x_range) = range(xs, self.x.scale) else {
            return Err(PlotError::Empty(name, "no series has a point".into()));
        };
        let draw_err = |e: &dyn std::fmt::Display| PlotError::Draw(name.clone(), e.to_string());
        let root = SVGBackend::new(path, self.size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| draw_err(&e))?;
        let root = root
            .titled(&self.title, ("sans-serif", 22))
            .map_err(|e| draw_err(&e))?;
        let areas = root.split_evenly((self.panels.len().max(1), 1));
        for (k, (panel, area)) in self.panels.iter().zip(&areas).enumerate() {
            let last = k + 1 == self.panels.len();
            self.draw_panel(panel, &mapped[k], area, x_range, last)
                .map_err(|e| draw_err(&e))?;
        }
        root.present().map_err(|e| draw_err(&e))?;
        Ok(())
    }

    fn draw_panel(
        &self,
        panel: &Panel,
        mapped: &[(usize, Vec<(f64, f64)>)],
        area: &DrawingArea<SVGBackend, Shift>,
        (x0, x1): (f64, f64),
        last: bool,
    ) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
        let (y0, y1) = range(
            mapped.iter().flat_map(|(_, pts)| pts.iter().map(|p| p.1)),
            panel.y.scale,
        )
        .unwrap_or((0.0, 1.0));
        let mut chart = ChartBuilder::on(area)
            .margin(12)
            .x_label_area_size(if last { 44 } else { 28 })
            .y_label_area_size(78)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        let x_ticks = |a: &f64| self.x.tick(*a);
        let y_ticks = |a: &f64| panel.y.tick(*a);
        let mut mesh = chart.configure_mesh();
        mesh.x_labels(labels(self.x.scale, x0, x1))
            .y_labels(labels(panel.y.scale, y0, y1))
            .x_label_formatter(&x_ticks)
            .y_label_formatter(&y_ticks)
            .y_desc(panel.y.label.as_str())
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 15))
            .light_line_style(WHITE.mix(0.0));
        if last {
            mesh.x_desc(self.x.label.as_str());
        }
        mesh.draw()?;

        // Spans under everything else, then markers, then the series; spans and markers
        // are named in the last panel's legend only, once.
        let span_kinds = kinds(self.spans.iter().map(|s| s.kind.as_str()));
        let marker_kinds = kinds(self.markers.iter().map(|m| m.kind.as_str()));
        let n_series = panel.series.len();
        for (i, kind) in span_kinds.iter().enumerate() {
            let c = colour(n_series + i);
            let rects = self
                .spans
                .iter()
                .filter(|s| s.kind == *kind)
                .filter_map(|s| {
                    let (a, b) = (self.x.scale.axis_of(s.from)?, self.x.scale.axis_of(s.to)?);
                    Some(Rectangle::new([(a, y0), (b, y1)], c.mix(0.18).filled()))
                });
            let drawn = chart.draw_series(rects)?;
            if last {
                drawn.label(*kind).legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 16, y + 5)], c.mix(0.35).filled())
                });
            }
        }
        for (i, kind) in marker_kinds.iter().enumerate() {
            let c = colour(n_series + span_kinds.len() + i);
            let lines = self
                .markers
                .iter()
                .filter(|m| m.kind == *kind)
                .filter_map(|m| {
                    let a = self.x.scale.axis_of(m.x)?;
                    Some(PathElement::new(vec![(a, y0), (a, y1)], c.stroke_width(1)))
                });
            let drawn = chart.draw_series(lines)?;
            if last {
                drawn.label(*kind).legend(move |(x, y)| {
                    PathElement::new(vec![(x + 8, y - 6), (x + 8, y + 6)], c.stroke_width(2))
                });
            }
            if last {
                let text = self
                    .markers
                    .iter()
                    .filter(|m| m.kind == *kind && !m.label.is_empty())
                    .filter_map(|m| {
                        let a = self.x.scale.axis_of(m.x)?;
                        Some(Text::new(
                            m.label.clone(),
                            (a, y1),
                            ("sans-serif", 11).into_font().color(&c),
                        ))
                    });
                chart.draw_series(text)?;
            }
        }
        for (i, pts) in mapped {
            let s = &panel.series[*i];
            let c = colour(*i);
            let style = c.stroke_width(2);
            let line: Vec<(f64, f64)> = match s.style {
                Style::Line => pts.clone(),
                Style::Steps => steps(pts, x1),
            };
            chart
                .draw_series(LineSeries::new(line, style))?
                .label(s.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], style));
            if s.style == Style::Line {
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(("sans-serif", 12))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()?;
        Ok(())
    }
}

/// How many tick labels to ask plotters for: on a log axis, about one per power (so that
/// ticks land on 1 KiB, 1 MiB, 10, 100 rather than between them); ten on a linear one.
fn labels(scale: Scale, lo: f64, hi: f64) -> usize {
    match scale {
        Scale::Linear => 10,
        _ => ((hi.floor() - lo.ceil()) as usize + 1).clamp(3, 12),
    }
}

/// A staircase through `pts` (sorted by x), the last value held to `end`.
fn steps(pts: &[(f64, f64)], end: f64) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(pts.len() * 2 + 1);
    for (i, &(x, y)) in pts.iter().enumerate() {
        if i > 0 {
            out.push((x, pts[i - 1].1));
        }
        out.push((x, y));
    }
    if let Some(&(x, y)) = pts.last() {
        if end > x {
            out.push((end, y));
        }
    }
    out
}

/// `v` as a short number: `0.25`, `12`, `1.5k`, `3.5M`.
pub fn number(v: f64) -> String {
    let a = v.abs();
    let (scaled, suffix) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e4 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let s = scaled.abs();
    let text = if s == 0.0 || s >= 100.0 {
        format!("{scaled:.0}")
    } else if s >= 10.0 {
        format!("{scaled:.1}")
    } else if s >= 0.01 {
        format!("{scaled:.2}")
    } else {
        format!("{scaled:.1e}")
    };
    let text = if text.contains('.') && !text.contains('e') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    };
    text + suffix
}

/// `v` bytes in powers of 1024: `512 B`, `4 KiB`, `1.5 MiB`.
pub fn bytes(v: f64) -> String {
    let mut x = v;
    let mut unit = 0;
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    while x.abs() >= 1024.0 && unit + 1 < UNITS.len() {
        x /= 1024.0;
        unit += 1;
    }
    format!("{} {}", number(x), UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_read_as_their_units() {
        assert_eq!(bytes(8.0), "8 B");
        assert_eq!(bytes(4096.0), "4 KiB");
        assert_eq!(bytes(64.0 * 1024.0 * 1024.0), "64 MiB");
        assert_eq!(bytes(1.5 * 1024.0 * 1024.0), "1.5 MiB");
        assert_eq!(number(0.25), "0.25");
        assert_eq!(number(12.0), "12");
        assert_eq!(number(2.5e6), "2.5M");
        assert_eq!(number(0.001), "1.0e-3");
        let members = Axis::new("members", Scale::Linear, Units::Count);
        assert_eq!(
            (members.tick(3.0), members.tick(3.5)),
            ("3".into(), String::new())
        );
    }

    #[test]
    fn log_axes_leave_out_what_they_cannot_show() {
        assert_eq!(Scale::Log2.axis_of(1024.0), Some(10.0));
        assert_eq!(Scale::Log10.axis_of(0.0), None);
        assert_eq!(Scale::Log10.axis_of(-3.0), None);
        assert_eq!(Scale::Linear.axis_of(-3.0), Some(-3.0));
        assert!((Scale::Log10.value_at(2.0) - 100.0).abs() < 1e-9);
    }

    #[test]
    fn a_staircase_holds_each_value_until_the_next_point() {
        let s = steps(&[(0.0, 3.0), (2.0, 2.0), (5.0, 3.0)], 8.0);
        assert_eq!(
            s,
            vec![
                (0.0, 3.0),
                (2.0, 3.0),
                (2.0, 2.0),
                (5.0, 2.0),
                (5.0, 3.0),
                (8.0, 3.0)
            ]
        );
    }

    fn figure() -> Figure {
        Figure {
            title: "t".into(),
            x: Axis::new("size", Scale::Log2, Units::Bytes),
            panels: vec![Panel {
                y: Axis::new("bus bandwidth (GB/s)", Scale::Log10, Units::Plain),
                series: vec![Series {
                    label: "eccl shm".into(),
                    points: vec![(1024.0, 0.5), (1048576.0, 4.0)],
                    style: Style::Line,
                }],
            }],
            markers: vec![Marker {
                x: 4096.0,
                kind: "kill".into(),
                label: "kill".into(),
            }],
            spans: vec![Span {
                from: 4096.0,
                to: 8192.0,
                kind: "abort".into(),
            }],
            size: (640, 400),
        }
    }

    #[test]
    fn a_figure_is_an_svg_with_its_series_named() {
        let dir = std::env::temp_dir().join(format!("eccl-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.svg");
        figure().write_svg(&path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        for text in [
            "eccl shm",
            "bus bandwidth (GB/s)",
            "size",
            "1 MiB",
            "kill",
            "abort",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }
    }

    #[test]
    fn what_cannot_be_drawn_is_refused_by_name() {
        let dir = std::env::temp_dir();
        let e = figure().write_svg(&dir.join("f.png")).unwrap_err();
        assert!(matches!(e, PlotError::NotSvg(_)), "{e}");
        let mut f = figure();
        f.panels[0].series[0].points = vec![(0.0, 1.0)];
        f.markers.clear();
        f.spans.clear();
        let e = f.write_svg(&dir.join("eccl-plot-empty.svg")).unwrap_err();
        assert!(e.to_string().contains("nothing to draw"), "{e}");
    }
}
