// SPDX-License-Identifier: Apache-2.0
//! Kubernetes resource quantities (`128Mi`, `1G`, `500m`, `2`, `1e3`).

/// A parsed quantity as a decimal number scaled by 1000 (milli-units),
/// saturating at `i128` bounds. Returns `None` for malformed input.
pub fn parse_quantity(s: &str) -> Option<i128> {
    let s = s.trim();
    if s.is_empty() || s.len() > 64 {
        return None;
    }
    let (sign, s) = match s.as_bytes()[0] {
        b'-' => (-1i128, &s[1..]),
        b'+' => (1, &s[1..]),
        _ => (1, s),
    };
    let num_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(num_end);
    if num.is_empty() || num == "." || num.matches('.').count() > 1 {
        return None;
    }
    let (int_part, frac_part) = num.split_once('.').unwrap_or((num, ""));
    // Value in units of 10^-9 to keep precision for `n`/`u` suffixes.
    let mut nanos: i128 = 0;
    for b in int_part.bytes() {
        nanos = nanos.checked_mul(10)?.checked_add(i128::from(b - b'0'))?;
    }
    nanos = nanos.checked_mul(1_000_000_000)?;
    let mut scale = 100_000_000i128;
    for b in frac_part.bytes().take(9) {
        nanos += i128::from(b - b'0') * scale;
        scale /= 10;
    }
    let mul = |n: i128, m: i128| n.checked_mul(m);
    let nanos = match suffix {
        "" => nanos,
        "n" => nanos / 1_000_000_000,
        "u" => nanos / 1_000_000,
        "m" => nanos / 1000,
        "k" => mul(nanos, 1000)?,
        "M" => mul(nanos, 1_000_000)?,
        "G" => mul(nanos, 1_000_000_000)?,
        "T" => mul(nanos, 1_000_000_000_000)?,
        "P" => mul(nanos, 1_000_000_000_000_000)?,
        "E" => mul(nanos, 1_000_000_000_000_000_000)?,
        "Ki" => mul(nanos, 1 << 10)?,
        "Mi" => mul(nanos, 1 << 20)?,
        "Gi" => mul(nanos, 1 << 30)?,
        "Ti" => mul(nanos, 1 << 40)?,
        "Pi" => mul(nanos, 1 << 50)?,
        "Ei" => mul(nanos, 1 << 60)?,
        e if e.starts_with(['e', 'E']) => {
            let exp: i32 = e[1..].parse().ok()?;
            if !(-9..=18).contains(&exp) {
                return None;
            }
            if exp >= 0 {
                mul(nanos, 10i128.pow(exp.unsigned_abs()))?
            } else {
                nanos / 10i128.pow(exp.unsigned_abs())
            }
        }
        _ => return None,
    };
    Some(sign * nanos / 1_000_000)
}

/// A quantity in whole units (bytes for memory and storage), rounded up.
/// `None` for malformed or negative input.
pub fn parse_quantity_bytes(s: &str) -> Option<u64> {
    let milli = parse_quantity(s)?;
    if milli < 0 {
        return None;
    }
    u64::try_from((milli + 999) / 1000).ok()
}

/// A quantity in milli-units (millicores for CPU). `None` for malformed or negative input.
pub fn parse_quantity_millis(s: &str) -> Option<u64> {
    let milli = parse_quantity(s)?;
    u64::try_from(milli).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_and_decimal_suffixes() {
        assert_eq!(parse_quantity_bytes("128Mi"), Some(128 << 20));
        assert_eq!(parse_quantity_bytes("1024M"), Some(1_024_000_000));
        assert_eq!(parse_quantity_bytes("2Gi"), Some(2 << 30));
        assert_eq!(parse_quantity_bytes("1.5Gi"), Some(3 << 29));
        assert_eq!(parse_quantity_bytes("1e3"), Some(1000));
        assert_eq!(parse_quantity_millis("500m"), Some(500));
        assert_eq!(parse_quantity_millis("2"), Some(2000));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "Mi",
            "12Q",
            "1..2",
            "-1Gi",
            "1e99",
            "abc",
            "9999999999999999999999999999999Ei",
        ] {
            assert_eq!(parse_quantity_bytes(bad), None, "{bad}");
        }
    }
}
