//! Python's `json.dumps` layout through serde_json: the separators and indentation HF's
//! `tojson` filter prints with, so a rendered prompt has the engine's bytes.

use std::io::Write;

use serde::Serialize;
use serde_json::ser::Formatter;

/// How to lay out the JSON: Python's `separators`, `indent` and `ensure_ascii`.
pub(crate) struct Style {
    /// Between items (`", "`, or `","` when indenting).
    pub item: String,
    /// Between a key and its value (`": "`).
    pub key: String,
    /// Spaces per level, with a newline before each item; `None`: one line.
    pub indent: Option<usize>,
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
}

struct PyFormatter<'a> {
    style: &'a Style,
    depth: usize,
    has_value: bool,
}

impl PyFormatter<'_> {
    fn newline<W: ?Sized + Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(n) = self.style.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.depth * n {
                w.write_all(b" ")?;
            }
        }
        Ok(())
    }

    fn open<W: ?Sized + Write>(&mut self, w: &mut W, c: &[u8]) -> std::io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        w.write_all(c)
    }

    fn close<W: ?Sized + Write>(&mut self, w: &mut W, c: &[u8]) -> std::io::Result<()> {
        self.depth -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        // The enclosing container has a value now: this one.
        self.has_value = true;
        w.write_all(c)
    }

    fn item<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(self.style.item.as_bytes())?;
        }
        self.newline(w)
    }
}

impl Formatter for PyFormatter<'_> {
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(self.style.key.as_bytes())
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// How an output refused for its cap says so.
pub(crate) const OVER_CAP: &str = "output over the render's cap";

/// A writer that takes at most `left` more bytes, then fails: what writes through it
/// (a chat template's render, `tojson`'s layout) stops there and holds no more.
pub(crate) struct CappedWriter {
    pub out: Vec<u8>,
    pub left: usize,
}

impl CappedWriter {
    pub fn new(cap: usize) -> Self {
        CappedWriter {
            out: Vec::new(),
            left: cap,
        }
    }
}

impl Write for CappedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() > self.left {
            self.left = 0;
            return Err(std::io::Error::other("over its cap"));
        }
        self.left -= buf.len();
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `value` as Python's `json.dumps` would print it with `style`, refused past `cap`
/// bytes.
pub(crate) fn dumps<T: Serialize + ?Sized>(
    value: &T,
    style: &Style,
    cap: usize,
) -> Result<String, String> {
    let mut out = CappedWriter::new(cap);
    let formatter = PyFormatter {
        style,
        depth: 0,
        has_value: false,
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    if let Err(e) = value.serialize(&mut ser) {
        return Err(if out.left == 0 {
            format!("{OVER_CAP} ({cap} bytes)")
        } else {
            e.to_string()
        });
    }
    let text = String::from_utf8(out.out).map_err(|e| e.to_string())?;
    if !style.ensure_ascii || text.is_ascii() {
        return Ok(text);
    }
    // Non-ASCII appears only inside strings, so escaping it everywhere is exact.
    let mut ascii = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if c.is_ascii() {
            ascii.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                ascii.push_str(&format!("\\u{u:04x}"));
            }
        }
        // Escaping grows a character up to 12 bytes: the cap holds here too.
        if ascii.len() > cap {
            return Err(format!("{OVER_CAP} ({cap} bytes)"));
        }
    }
    Ok(ascii)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn style(indent: Option<usize>) -> Style {
        Style {
            item: if indent.is_some() { "," } else { ", " }.into(),
            key: ": ".into(),
            indent,
            ensure_ascii: false,
        }
    }

    #[test]
    fn matches_python_layouts() {
        let v = serde_json::json!({"a": [1, {"b": "é"}], "c": {}, "d": []});
        // json.dumps(v, ensure_ascii=False)
        assert_eq!(
            dumps(&v, &style(None), usize::MAX).unwrap(),
            r#"{"a": [1, {"b": "é"}], "c": {}, "d": []}"#
        );
        // json.dumps(v, ensure_ascii=False, indent=2)
        assert_eq!(
            dumps(&v, &style(Some(2)), usize::MAX).unwrap(),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": \"é\"\n    }\n  ],\n  \"c\": {},\n  \"d\": []\n}"
        );
        let ascii = Style {
            ensure_ascii: true,
            ..style(None)
        };
        // json.dumps("é😀")
        assert_eq!(
            dumps("é😀", &ascii, usize::MAX).unwrap(),
            r#""\u00e9\ud83d\ude00""#
        );
        // Past its cap the layout stops where it is: an error, not the whole string.
        let e = dumps(&v, &style(Some(2)), 10).unwrap_err();
        assert!(e.contains(OVER_CAP), "{e}");
        assert!(dumps("é😀", &ascii, 6).unwrap_err().contains(OVER_CAP));
    }
}
