//! Kubernetes quantity strings (`512Mi`, `1G`, `500m`, `1e3`) turned into the
//! integers cgroup v2 files take.
//!
//! The API types carry quantities as plain strings
//! (`k8s_openapi::apimachinery::pkg::api::resource::Quantity` is a string
//! wrapper), and the only conversions the agent needs are "bytes" and
//! "millicores", so a small exact parser is enough. It works in integers
//! (u128) so `1.1Gi` is exact, and rounds up like Kubernetes' `Value()`.

/// A quantity string that cannot be turned into a limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid quantity {input:?}: {reason}")]
pub struct QuantityError {
    /// The string as given.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// Bytes for `memory.max` from a quantity such as `512Mi`, `1G` or `1000000`.
///
/// Accepts an unsigned decimal number (a fraction is allowed) followed by
/// nothing, a decimal suffix `k M G T P E`, a binary suffix
/// `Ki Mi Gi Ti Pi Ei`, or a decimal exponent `e<n>`/`E<n>`. Fractions of a
/// byte round up. Zero, negative numbers and `m`/`u`/`n` (sub-byte) suffixes
/// are refused.
pub fn parse_memory_quantity(input: &str) -> Result<u64, QuantityError> {
    let parsed = parse(input)?;
    if parsed.small_suffix {
        return Err(error(
            input,
            "a memory quantity cannot use a sub-unit suffix (m, u, n)",
        ));
    }
    positive(input, parsed.scaled_ceil(0, input)?)
}

/// Millicores for `cpu.max` from a quantity of cores such as `500m`, `2` or
/// `0.25`. Anything finer than a millicore rounds up. Zero and negative
/// numbers are refused.
pub fn parse_cpu_quantity(input: &str) -> Result<u64, QuantityError> {
    let parsed = parse(input)?;
    positive(input, parsed.scaled_ceil(3, input)?)
}

fn positive(input: &str, value: u64) -> Result<u64, QuantityError> {
    if value == 0 {
        return Err(error(input, "it must be greater than zero"));
    }
    Ok(value)
}

fn error(input: &str, reason: &'static str) -> QuantityError {
    QuantityError {
        input: input.to_owned(),
        reason,
    }
}

/// value = digits × 10^decimal_exponent × 2^binary_exponent
struct Parsed {
    digits: u128,
    decimal_exponent: i32,
    binary_exponent: u32,
    small_suffix: bool,
}

impl Parsed {
    /// ceil(value × 10^unit_exponent) as u64.
    fn scaled_ceil(&self, unit_exponent: i32, input: &str) -> Result<u64, QuantityError> {
        let too_large = || error(input, "it is too large");
        let exponent = self.decimal_exponent + unit_exponent;
        let mut numerator = self
            .digits
            .checked_mul(
                1u128
                    .checked_shl(self.binary_exponent)
                    .ok_or_else(too_large)?,
            )
            .ok_or_else(too_large)?;
        let mut denominator: u128 = 1;
        if exponent >= 0 {
            let factor = 10u128
                .checked_pow(exponent.unsigned_abs())
                .ok_or_else(too_large)?;
            numerator = numerator.checked_mul(factor).ok_or_else(too_large)?;
        } else {
            match 10u128.checked_pow(exponent.unsigned_abs()) {
                Some(factor) => denominator = factor,
                // Smaller than any representable unit but not zero: one unit.
                None => return Ok(u64::from(numerator != 0)),
            }
        }
        u64::try_from(numerator.div_ceil(denominator)).map_err(|_| too_large())
    }
}

fn parse(input: &str) -> Result<Parsed, QuantityError> {
    let text = input.trim();
    if text.is_empty() {
        return Err(error(input, "it is empty"));
    }
    if text.starts_with('-') {
        return Err(error(input, "it must not be negative"));
    }
    let text = text.strip_prefix('+').unwrap_or(text);
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return Err(error(input, "it does not start with a number"));
    }
    if fraction.contains('.') {
        return Err(error(input, "it has more than one decimal point"));
    }
    let all_digits = format!("{whole}{fraction}");
    let significant = all_digits.trim_start_matches('0');
    if significant.len() > 30 {
        return Err(error(input, "it has too many digits"));
    }
    let digits = if significant.is_empty() {
        0
    } else {
        significant
            .parse::<u128>()
            .map_err(|_| error(input, "it is not a number"))?
    };
    let fraction_len =
        i32::try_from(fraction.len()).map_err(|_| error(input, "it has too many digits"))?;
    let (decimal, binary, small_suffix) = suffix_scale(suffix).ok_or_else(|| {
        error(
            input,
            "unknown suffix (use k, M, G, T, P, E, Ki, Mi, Gi, Ti, Pi, Ei, m, or e<n>)",
        )
    })?;
    Ok(Parsed {
        digits,
        decimal_exponent: decimal - fraction_len,
        binary_exponent: binary,
        small_suffix,
    })
}

/// (power of ten, power of two, is a sub-unit suffix) for a suffix.
fn suffix_scale(suffix: &str) -> Option<(i32, u32, bool)> {
    let scale = match suffix {
        "" => (0, 0, false),
        "n" => (-9, 0, true),
        "u" => (-6, 0, true),
        "m" => (-3, 0, true),
        "k" => (3, 0, false),
        "M" => (6, 0, false),
        "G" => (9, 0, false),
        "T" => (12, 0, false),
        "P" => (15, 0, false),
        "E" => (18, 0, false),
        "Ki" => (0, 10, false),
        "Mi" => (0, 20, false),
        "Gi" => (0, 30, false),
        "Ti" => (0, 40, false),
        "Pi" => (0, 50, false),
        "Ei" => (0, 60, false),
        _ => {
            // A decimal exponent: e3, E-2, e+6. A bare "E" is exa, matched above.
            let exponent = suffix.strip_prefix(['e', 'E'])?;
            let digits = exponent.strip_prefix(['+', '-']).unwrap_or(exponent);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.len() > 3
            {
                return None;
            }
            let value: i32 = exponent.parse().ok()?;
            (value, 0, value < 0)
        }
    };
    Some(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_binary_and_decimal_suffixes() {
        assert_eq!(parse_memory_quantity("512Mi"), Ok(512 * 1024 * 1024));
        assert_eq!(parse_memory_quantity("1G"), Ok(1_000_000_000));
        assert_eq!(parse_memory_quantity("1000000"), Ok(1_000_000));
        assert_eq!(parse_memory_quantity("64k"), Ok(64_000));
        assert_eq!(parse_memory_quantity("2Ki"), Ok(2048));
        assert_eq!(parse_memory_quantity("1Ti"), Ok(1 << 40));
        assert_eq!(parse_memory_quantity("3E"), Ok(3_000_000_000_000_000_000));
        assert_eq!(parse_memory_quantity("1Ei"), Ok(1 << 60));
        assert_eq!(parse_memory_quantity("1e3"), Ok(1000));
        assert_eq!(parse_memory_quantity("1E6"), Ok(1_000_000));
    }

    #[test]
    fn memory_fractions_are_exact_and_round_up() {
        assert_eq!(parse_memory_quantity("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_memory_quantity("0.5Ki"), Ok(512));
        assert_eq!(parse_memory_quantity("1.0000001k"), Ok(1001));
    }

    #[test]
    fn cpu_in_millicores() {
        assert_eq!(parse_cpu_quantity("500m"), Ok(500));
        assert_eq!(parse_cpu_quantity("2"), Ok(2000));
        assert_eq!(parse_cpu_quantity("0.25"), Ok(250));
        assert_eq!(parse_cpu_quantity("1.5"), Ok(1500));
        assert_eq!(parse_cpu_quantity("100u"), Ok(1));
        assert_eq!(parse_cpu_quantity("1500000n"), Ok(2));
    }

    #[test]
    fn bad_input_is_refused_with_a_reason() {
        for bad in [
            "", "  ", "abc", "-1", "-512Mi", "12XB", "1..2", "1.2.3", "Mi", "0", "0Mi", "1e",
            "1ee3",
        ] {
            let err = parse_memory_quantity(bad).expect_err(bad);
            assert_eq!(err.input, bad);
            assert!(err.to_string().contains("invalid quantity"), "{err}");
        }
        for bad in ["0m", "-500m", "two", "1 cpu"] {
            assert!(parse_cpu_quantity(bad).is_err(), "{bad} must be refused");
        }
        assert!(parse_memory_quantity("500m").is_err(), "sub-byte memory");
        assert!(parse_memory_quantity("99999999999E").is_err(), "overflow");
    }
}
