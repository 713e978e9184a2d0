//! `bbc bench`'s charts as standalone SVG: throughput against interactivity for a sweep (as
//! InferenceX plots its results), latency against time for sustained and bursty load. Points
//! are marks, optionally joined in order and labelled; axes start at zero and end at a round
//! number past the largest value.

use std::fmt::Write;

/// One set of points, drawn in one colour.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// A short label beside each point (e.g. its concurrency), or none.
    pub labels: Vec<String>,
    /// Join the points in order with a line.
    pub joined: bool,
}

pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 480.0;
/// The plot area inside the margins (left, top, right, bottom).
const AREA: (f64, f64, f64, f64) = (80.0, 50.0, 560.0, 420.0);
const COLOURS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
const TICKS: usize = 5;

impl Chart {
    pub fn to_svg(&self) -> String {
        let finite = |v: f64| v.is_finite().then_some(v.max(0.0));
        let all = self.series.iter().flat_map(|s| s.points.iter());
        let x_max = axis_end(all.clone().filter_map(|p| finite(p.0)).fold(0.0, f64::max));
        let y_max = axis_end(all.filter_map(|p| finite(p.1)).fold(0.0, f64::max));
        let (left, top, right, bottom) = AREA;
        let x_at = |x: f64| left + (x / x_max).clamp(0.0, 1.0) * (right - left);
        let y_at = |y: f64| bottom - (y / y_max).clamp(0.0, 1.0) * (bottom - top);
        let mut svg = String::new();
        let _ = write!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = write!(svg, r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#);
        let _ = write!(
            svg,
            r#"<text x="{}" y="28" font-size="15" text-anchor="middle">{}</text>"#,
            WIDTH / 2.0,
            escape(&self.title)
        );
        // Grid and ticks.
        for i in 0..=TICKS {
            let (x, y) = (x_max * i as f64 / TICKS as f64, y_max * i as f64 / TICKS as f64);
            let _ = write!(
                svg,
                r##"<line x1="{0}" y1="{top}" x2="{0}" y2="{bottom}" stroke="#ddd"/><text x="{0}" y="{1}" text-anchor="middle">{2}</text>"##,
                x_at(x),
                bottom + 18.0,
                tick(x)
            );
            let _ = write!(
                svg,
                r##"<line x1="{left}" y1="{0}" x2="{right}" y2="{0}" stroke="#ddd"/><text x="{1}" y="{2}" text-anchor="end">{3}</text>"##,
                y_at(y),
                left - 6.0,
                y_at(y) + 4.0,
                tick(y)
            );
        }
        let _ = write!(
            svg,
            r#"<rect x="{left}" y="{top}" width="{}" height="{}" fill="none" stroke="black"/>"#,
            right - left,
            bottom - top
        );
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            (left + right) / 2.0,
            bottom + 40.0,
            escape(&self.x_label)
        );
        let _ = write!(
            svg,
            r#"<text x="20" y="{0}" text-anchor="middle" transform="rotate(-90 20 {0})">{1}</text>"#,
            (top + bottom) / 2.0,
            escape(&self.y_label)
        );
        for (i, series) in self.series.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            // The drawable points with their labels: a point with a value that is not a
            // number (a run with no TPOT, say) is left out, and so is its label.
            let marks: Vec<(f64, f64, Option<&String>)> = series
                .points
                .iter()
                .enumerate()
                .filter_map(|(j, &(x, y))| Some((x_at(finite(x)?), y_at(finite(y)?), series.labels.get(j))))
                .collect();
            if series.joined && marks.len() > 1 {
                let path: Vec<String> = marks.iter().map(|(x, y, _)| format!("{x:.1},{y:.1}")).collect();
                let _ = write!(
                    svg,
                    r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="1.5"/>"#,
                    path.join(" ")
                );
            }
            for &(x, y, label) in &marks {
                let _ = write!(svg, r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{colour}"/>"#);
                if let Some(label) = label {
                    let _ = write!(
                        svg,
                        r#"<text x="{:.1}" y="{:.1}" font-size="10">{}</text>"#,
                        x + 5.0,
                        y - 5.0,
                        escape(label)
                    );
                }
            }
            let legend_y = top + 16.0 * i as f64 + 8.0;
            let _ = write!(
                svg,
                r#"<circle cx="{}" cy="{legend_y}" r="4" fill="{colour}"/><text x="{}" y="{}">{}</text>"#,
                right + 16.0,
                right + 26.0,
                legend_y + 4.0,
                escape(&series.name)
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

/// A round number at or past `max` (1, 2 or 5 times a power of ten), so ticks at fifths of it
/// are round too; 1 for an empty or zero axis.
fn axis_end(max: f64) -> f64 {
    if max <= 0.0 {
        return 1.0;
    }
    let power = 10f64.powf(max.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * power)
        .find(|&end| end >= max)
        .unwrap_or(10.0 * power)
}

fn tick(v: f64) -> String {
    if v == v.round() && v.abs() < 1e9 {
        format!("{v:.0}")
    } else {
        let text = format!("{v:.3}");
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(series: Vec<Series>) -> String {
        Chart {
            title: "t <1>".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series,
        }
        .to_svg()
    }

    #[test]
    fn axes_end_at_round_numbers_past_the_data() {
        assert_eq!(axis_end(0.0), 1.0);
        assert_eq!(axis_end(0.7), 1.0);
        assert_eq!(axis_end(1.0), 1.0);
        assert_eq!(axis_end(1.2), 2.0);
        assert_eq!(axis_end(37.0), 50.0);
        assert_eq!(axis_end(5147.0), 10_000.0);
        assert_eq!(axis_end(0.031), 0.05);
        assert_eq!(tick(2000.0), "2000");
        assert_eq!(tick(0.01), "0.01");
    }

    /// Every point is a mark inside the plot area, at its place on the axes; a joined series
    /// is one polyline through them in order; labels and names are escaped.
    #[test]
    fn points_land_where_their_values_say() {
        let svg = chart(vec![
            Series {
                name: "ISL 1024 & OSL 1024".into(),
                points: vec![(10.0, 100.0), (25.0, f64::NAN), (50.0, 400.0)],
                labels: vec!["C1".into(), "C4".into(), "C16".into()],
                joined: true,
            },
            Series {
                name: "b".into(),
                points: vec![(0.0, 0.0)],
                labels: vec![],
                joined: false,
            },
        ]);
        assert!(svg.starts_with("<svg ") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(
            svg.matches("<circle").count(),
            2 + 1 + 2,
            "two finite points, one, two legend marks"
        );
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert!(svg.contains("ISL 1024 &amp; OSL 1024") && svg.contains("t &lt;1&gt;"));
        // x axis 0..50 over 80..560, y axis 0..500 over 420..50.
        assert!(svg.contains(r#"<circle cx="176.0" cy="346.0""#), "{svg}");
        assert!(svg.contains(r#"<circle cx="560.0" cy="124.0""#), "{svg}");
        assert!(svg.contains(r#"<circle cx="80.0" cy="420.0""#), "{svg}");
        assert!(svg.contains(r#"points="176.0,346.0 560.0,124.0""#), "{svg}");
        assert!(
            svg.contains(">C1</text>") && svg.contains(">C16</text>"),
            "labels follow their points"
        );
        assert!(!svg.contains(">C4</text>"), "no label for a point left out");
    }

    #[test]
    fn an_empty_chart_still_draws_its_axes() {
        let svg = chart(vec![]);
        assert_eq!(svg.matches("<circle").count(), 0);
        assert!(svg.contains(">1</text>") && svg.contains(">0</text>"));
    }
}
