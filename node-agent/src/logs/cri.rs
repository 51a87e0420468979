//! The CRI logging format the kubelet writes for containers, one record a
//! line: `<RFC 3339 nano time> <stdout|stderr> <P|F> <text>`. `F` ends a
//! line the process wrote; `P` is a piece of a longer one, continued by the
//! next record of the same stream. Node log collectors (fluent-bit's `cri`
//! parser, Vector's `kubernetes_logs`, Promtail/Alloy's `cri` stage) read it
//! as they read the kubelet's.

use std::fmt;

use jiff::Timestamp;

/// The longest text one record carries; a longer line is split into `P`
/// records (the kubelet's limit, 16 KiB).
pub const MAX_RECORD_TEXT: usize = 16 * 1024;

/// Which output of the process a record came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// One record, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record<'a> {
    pub time: &'a str,
    pub stream: Stream,
    /// `false` for a `P` record.
    pub full: bool,
    pub text: &'a [u8],
}

/// Why a line is not a CRI record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotARecord(pub String);

impl fmt::Display for NotARecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not a CRI log record: {}", self.0)
    }
}

/// Appends one record for `text` (no newline in it) to `out`.
pub fn encode(out: &mut Vec<u8>, time: Timestamp, stream: Stream, full: bool, text: &[u8]) {
    // jiff prints RFC 3339 in UTC with `Z` and only the fractional digits
    // needed, as Go's RFC3339Nano does.
    out.extend_from_slice(time.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(stream.as_str().as_bytes());
    out.extend_from_slice(if full { b" F " } else { b" P " });
    out.extend_from_slice(text);
    out.push(b'\n');
}

/// Parses one line (without its newline).
pub fn parse(line: &[u8]) -> Result<Record<'_>, NotARecord> {
    let bad = |why: &str| NotARecord(format!("{why}: {:?}", String::from_utf8_lossy(line)));
    let mut parts = line.splitn(4, |b| *b == b' ');
    let time = parts.next().ok_or_else(|| bad("no time"))?;
    let time = std::str::from_utf8(time).map_err(|_| bad("time is not text"))?;
    time.parse::<Timestamp>()
        .map_err(|e| bad(&format!("time {time:?} is not RFC 3339 ({e})")))?;
    let stream = match parts.next() {
        Some(b"stdout") => Stream::Stdout,
        Some(b"stderr") => Stream::Stderr,
        _ => return Err(bad("the stream is neither stdout nor stderr")),
    };
    let full = match parts.next() {
        Some(b"F") => true,
        Some(b"P") => false,
        _ => return Err(bad("the tag is neither P nor F")),
    };
    Ok(Record {
        time,
        stream,
        full,
        text: parts.next().unwrap_or_default(),
    })
}

/// Splits a stream's bytes into records: each complete line becomes one or
/// more records (`P` pieces of at most [`MAX_RECORD_TEXT`], the last `F`),
/// and an unfinished line waits for more input, or is flushed as `P`
/// pieces once it outgrows the limit.
#[derive(Debug, Default)]
pub struct LineSplitter {
    pending: Vec<u8>,
}

impl LineSplitter {
    /// Feeds `input`; calls `emit(full, text)` for each record ready.
    pub fn feed(&mut self, input: &[u8], mut emit: impl FnMut(bool, &[u8])) {
        let mut rest = input;
        while let Some(newline) = rest.iter().position(|b| *b == b'\n') {
            self.pending.extend_from_slice(&rest[..newline]);
            rest = &rest[newline + 1..];
            self.flush_line(&mut emit);
        }
        self.pending.extend_from_slice(rest);
        while self.pending.len() > MAX_RECORD_TEXT {
            emit(false, &self.pending[..MAX_RECORD_TEXT]);
            self.pending.drain(..MAX_RECORD_TEXT);
        }
    }

    /// The stream ended: what is left is its last line.
    pub fn finish(&mut self, mut emit: impl FnMut(bool, &[u8])) {
        if !self.pending.is_empty() {
            self.flush_line(&mut emit);
        }
    }

    fn flush_line(&mut self, emit: &mut impl FnMut(bool, &[u8])) {
        let mut line = self.pending.as_slice();
        while line.len() > MAX_RECORD_TEXT {
            emit(false, &line[..MAX_RECORD_TEXT]);
            line = &line[MAX_RECORD_TEXT..];
        }
        emit(true, line);
        self.pending.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(chunks: &[&[u8]]) -> Vec<(bool, Vec<u8>)> {
        let mut out = Vec::new();
        let mut splitter = LineSplitter::default();
        for chunk in chunks {
            splitter.feed(chunk, |full, text| out.push((full, text.to_vec())));
        }
        splitter.finish(|full, text| out.push((full, text.to_vec())));
        out
    }

    #[test]
    fn an_encoded_record_parses_back() {
        let mut line = Vec::new();
        let time: Timestamp = "2026-12-01T07:34:50.123456789Z".parse().expect("a time");
        encode(&mut line, time, Stream::Stderr, true, b"GET / 200");
        assert_eq!(
            line,
            b"2026-12-01T07:34:50.123456789Z stderr F GET / 200\n".to_vec()
        );
        let record = parse(&line[..line.len() - 1]).expect("parses");
        assert_eq!(record.stream, Stream::Stderr);
        assert!(record.full);
        assert_eq!(record.text, b"GET / 200");
    }

    #[test]
    fn a_text_with_spaces_and_an_empty_text_survive() {
        let record = parse(b"2026-12-01T07:34:50Z stdout P a  b ").expect("parses");
        assert!(!record.full);
        assert_eq!(record.text, b"a  b ");
        assert_eq!(
            parse(b"2026-12-01T07:34:50Z stdout F")
                .expect("parses")
                .text,
            b""
        );
    }

    #[test]
    fn lines_that_are_not_records_are_refused() {
        for line in [
            &b"hello world"[..],
            b"2026-12-01T07:34:50Z stdin F x",
            b"2026-12-01T07:34:50Z stdout X x",
            b"yesterday stdout F x",
        ] {
            assert!(parse(line).is_err(), "{:?}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn lines_split_across_reads_join_and_a_last_unterminated_line_is_kept() {
        assert_eq!(
            records(&[b"one\ntw", b"o\n\nthr", b"ee"]),
            vec![
                (true, b"one".to_vec()),
                (true, b"two".to_vec()),
                (true, b"".to_vec()),
                (true, b"three".to_vec()),
            ]
        );
    }

    #[test]
    fn a_long_line_becomes_partial_records_then_a_full_one() {
        let long = vec![b'x'; MAX_RECORD_TEXT * 2 + 10];
        let mut input = long.clone();
        input.push(b'\n');
        let out = records(&[&input[..1000], &input[1000..]]);
        assert_eq!(
            out.iter().map(|(f, t)| (*f, t.len())).collect::<Vec<_>>(),
            vec![
                (false, MAX_RECORD_TEXT),
                (false, MAX_RECORD_TEXT),
                (true, 10)
            ]
        );
        let joined: Vec<u8> = out.into_iter().flat_map(|(_, t)| t).collect();
        assert_eq!(joined, long);
    }
}
