//! Percentiles and their printing.

use serde::{Deserialize, Serialize};

/// p50, p99 and max of a set of values in milliseconds, and how many.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Spread {
    /// How many values.
    pub count: usize,
    /// Median.
    pub p50: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (any order).
    pub fn of(mut values: Vec<f64>) -> Spread {
        if values.is_empty() {
            return Spread::default();
        }
        values.sort_by(f64::total_cmp);
        Spread {
            count: values.len(),
            p50: percentile(&values, 50),
            p99: percentile(&values, 99),
            max: values[values.len() - 1],
        }
    }

    /// `p50 / p99 / max` in ms, or `-` when empty.
    pub fn text(&self) -> String {
        if self.count == 0 {
            return "-".into();
        }
        format!("{} / {} / {}", ms(self.p50), ms(self.p99), ms(self.max))
    }

    /// `p50 / p99` in ms, or `-` when empty.
    pub fn text2(&self) -> String {
        if self.count == 0 {
            return "-".into();
        }
        format!("{} / {}", ms(self.p50), ms(self.p99))
    }
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: usize) -> f64 {
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted[rank.min(sorted.len()) - 1]
}

/// A duration in ms, with precision that suits its size.
pub fn ms(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else if value >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

/// `a / b` as a ratio, saying so when `b` is zero.
pub fn ratio(a: f64, b: f64) -> String {
    if b == 0.0 {
        if a == 0.0 {
            "=".into()
        } else {
            format!("{a:.0} vs 0")
        }
    } else {
        format!("{:.1}x", a / b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let spread = Spread::of((1..=100).rev().map(f64::from).collect());
        assert_eq!(spread.count, 100);
        assert_eq!(spread.p50, 50.0);
        assert_eq!(spread.p99, 99.0);
        assert_eq!(spread.max, 100.0);
        assert_eq!(Spread::of(vec![]).text(), "-");
    }
}
