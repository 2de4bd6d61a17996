//! The line parser (v1 and v1.1).
//!
//! A line is read in one pass into [`RawEvent`]: every known field is taken whatever its JSON type
//! (so an event ignores the fields it does not use, as the format says), page lists go into
//! buffers reused from line to line, and nothing is allocated for strings without escapes. Then
//! [`RawEvent::event`] checks the fields the event needs and builds an [`Event`] borrowing them.
//!
//! Fields the parser ignores are still read as JSON, not skipped blind: their strings must be
//! UTF-8 and their nesting at most 128 deep (serde_json's limit), as for the fields it uses.

use super::error::{Found, ReplayErrorKind};
use super::event::{Event, EventKind};
use crate::ids::{PageId, RequestId};
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use std::borrow::Cow;
use std::fmt;

macro_rules! fields {
    ($($variant:ident => $name:literal,)*) => {
        /// The field names v1 knows.
        #[derive(Clone, Copy, PartialEq, Eq, Debug)]
        enum Field { $($variant,)* Other }

        impl Field {
            const COUNT: usize = [$($name,)*].len();

            fn from_name(name: &str) -> Field {
                Field::from_bytes(name.as_bytes())
            }


            fn name(self) -> &'static str {
                match self { $(Field::$variant => $name,)* Field::Other => "?" }
            }
        }
    };
}

fields! {
    Ev => "ev",
    Req => "req",
    Tenant => "tenant",
    Prompt => "prompt",
    MaxNew => "max_new",
    Pages => "pages",
    Page => "page",
    Slots => "slots",
    Tokens => "tokens",
    Key => "key",
    Expect => "expect",
    Child => "child",
    PageSize => "page_size",
    MaxContext => "max_context",
    Reserved => "reserved",
    Version => "version",
    ScrubOnRelease => "scrub_on_release",
}

impl Field {
    /// The field named `name` (the names of [`Field::name`], as a match the compiler dispatches
    /// on length and bytes rather than one comparison per field).
    fn from_bytes(name: &[u8]) -> Field {
        match name {
            b"ev" => Field::Ev,
            b"req" => Field::Req,
            b"tenant" => Field::Tenant,
            b"prompt" => Field::Prompt,
            b"max_new" => Field::MaxNew,
            b"pages" => Field::Pages,
            b"page" => Field::Page,
            b"slots" => Field::Slots,
            b"tokens" => Field::Tokens,
            b"key" => Field::Key,
            b"expect" => Field::Expect,
            b"child" => Field::Child,
            b"page_size" => Field::PageSize,
            b"max_context" => Field::MaxContext,
            b"reserved" => Field::Reserved,
            b"version" => Field::Version,
            b"scrub_on_release" => Field::ScrubOnRelease,
            _ => Field::Other,
        }
    }
}

impl<'de> de::Deserialize<'de> for Field {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Field, D::Error> {
        struct FieldVisitor;
        impl Visitor<'_> for FieldVisitor {
            type Value = Field;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
                Ok(Field::from_name(v))
            }
        }
        d.deserialize_identifier(FieldVisitor)
    }
}

/// One field's value, whatever its type. Lists live in [`ListBuffers`].
#[derive(Debug)]
enum Value<'de> {
    Uint(u64),
    Bool(bool),
    Text(Cow<'de, str>),
    /// `len` elements in all (at most the cap of them kept); `bad` when one is not a `u64`.
    List {
        len: u64,
        bad: bool,
    },
    Other(Found),
}

/// How long the lists of one line may be, and how many of their elements the parser keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ListCaps {
    /// `pages` of every event but `read`, and `reserved`: a valid event names each page at most
    /// once, so a longer list is malformed (the pool's page count).
    pub pages: u64,
    /// `read.pages`: the elements kept. A longer block table (padding) is judged on these when
    /// its `tokens` lie within them; one whose tokens need more is malformed.
    pub read: u64,
    /// Tokens per page, to tell which entries a read covers; 0 keeps no padding (a `read` list
    /// longer than `read` is then refused like any other).
    pub page_size: u64,
}

impl ListCaps {
    /// Lists of at most `pages` elements, no padding kept (before the pool, or outside a replay).
    pub fn strict(pages: u64) -> ListCaps {
        ListCaps { pages, read: pages, page_size: 0 }
    }

    /// Elements of a `pages` list kept while parsing, before the event is known.
    fn keep(&self) -> u64 {
        self.pages.max(self.read)
    }
}

/// `slots` is a pair: the parser keeps at most this many of its elements (and counts the rest).
const SLOTS_KEPT: u64 = 2;

/// Reused buffers for the three list fields.
#[derive(Default, Debug)]
pub(crate) struct ListBuffers {
    pages: Vec<u64>,
    slots: Vec<u64>,
    reserved: Vec<u64>,
}

/// One parsed line: each known field's value, before the event checks them.
#[derive(Default)]
pub(crate) struct RawEvent<'de> {
    values: [Option<Value<'de>>; Field::COUNT],
    duplicate: Option<Field>,
}

/// Parses one line (no newline) into `bufs`; page lists keep at most [`ListCaps::keep`] elements,
/// `slots` at most two.
#[cfg(test)]
pub(crate) fn parse_line<'de>(
    line: &'de [u8],
    bufs: &mut ListBuffers,
    caps: ListCaps,
) -> Result<RawEvent<'de>, ReplayErrorKind> {
    let mut raw = RawEvent::default();
    parse_line_into(line, &mut raw, bufs, caps)?;
    Ok(raw)
}

/// Parses one line (no newline) into `raw`, which must be empty ([`RawEvent::default`]), and
/// `bufs`; page lists keep at most [`ListCaps::keep`] elements, `slots` at most two. (Filled in
/// place: the raw event is a few hundred bytes, too many to move for every line.)
pub(crate) fn parse_line_into<'de>(
    line: &'de [u8],
    raw: &mut RawEvent<'de>,
    bufs: &mut ListBuffers,
    caps: ListCaps,
) -> Result<(), ReplayErrorKind> {
    bufs.pages.clear();
    bufs.slots.clear();
    bufs.reserved.clear();
    if parse_plain(line, raw, bufs, caps).is_some() {
        return Ok(());
    }
    *raw = parse_json(line, bufs, caps)?;
    Ok(())
}

/// [`parse_line_into`] through serde_json, for any line (the reference the fast path must match).
fn parse_json<'de>(line: &'de [u8], bufs: &mut ListBuffers, caps: ListCaps) -> Result<RawEvent<'de>, ReplayErrorKind> {
    bufs.pages.clear();
    bufs.slots.clear();
    bufs.reserved.clear();
    let mut de = serde_json::Deserializer::from_slice(line);
    let raw = de::Deserializer::deserialize_map(&mut de, EventVisitor { bufs, caps }).map_err(ReplayErrorKind::Json)?;
    de.end().map_err(ReplayErrorKind::Json)?;
    Ok(raw)
}

/// The fast path of [`parse_line_into`], for the lines engines write: one flat object of known fields,
/// each once, whose values are unsigned integers, ASCII strings without escapes, `true`/`false`
/// or lists of unsigned integers. Any other line (whitespace inside lists aside) is `None`, and
/// serde_json reads it instead; for a line it takes, the result is what serde_json's pass gives.
fn parse_plain<'de>(line: &'de [u8], raw: &mut RawEvent<'de>, bufs: &mut ListBuffers, caps: ListCaps) -> Option<()> {
    let mut cur = Cursor { line, at: 0 };
    if !cur.eat(b'{') {
        return None;
    }
    if !cur.eat(b'}') {
        loop {
            let field = Field::from_bytes(cur.string()?);
            if field == Field::Other || raw.values[field as usize].is_some() || !cur.eat(b':') {
                return None;
            }
            cur.space();
            let value = match cur.peek()? {
                b'"' => {
                    let bytes = cur.string()?;
                    // An event's name is taken as its own static spelling, the same text without
                    // a UTF-8 pass over it.
                    let known = if field == Field::Ev { EventKind::from_bytes(bytes) } else { None };
                    match known {
                        Some(kind) => Value::Text(Cow::Borrowed(kind.as_str())),
                        None => Value::Text(Cow::Borrowed(std::str::from_utf8(bytes).ok()?)),
                    }
                }
                b't' if line[cur.at..].starts_with(b"true") => {
                    cur.at += 4;
                    Value::Bool(true)
                }
                b'f' if line[cur.at..].starts_with(b"false") => {
                    cur.at += 5;
                    Value::Bool(false)
                }
                b'[' => {
                    let (list, cap) = match field {
                        Field::Pages => (&mut bufs.pages, caps.keep()),
                        Field::Slots => (&mut bufs.slots, SLOTS_KEPT),
                        Field::Reserved => (&mut bufs.reserved, caps.pages),
                        _ => return None,
                    };
                    cur.at += 1;
                    let mut len = 0u64;
                    if !cur.eat(b']') {
                        loop {
                            let v = cur.uint()?;
                            len = len.saturating_add(1);
                            if (list.len() as u64) < cap {
                                list.push(v);
                            }
                            // The usual separator first, without the whitespace scan.
                            match cur.peek() {
                                Some(b',') => cur.at += 1,
                                Some(b']') => {
                                    cur.at += 1;
                                    break;
                                }
                                _ => {
                                    if cur.eat(b']') {
                                        break;
                                    }
                                    if !cur.eat(b',') {
                                        return None;
                                    }
                                }
                            }
                        }
                    }
                    Value::List { len, bad: false }
                }
                _ => Value::Uint(cur.uint()?),
            };
            raw.values[field as usize] = Some(value);
            if cur.eat(b'}') {
                break;
            }
            if !cur.eat(b',') {
                return None;
            }
        }
    }
    cur.space();
    (cur.at == line.len()).then_some(())
}

/// [`parse_plain`]'s place in its line.
struct Cursor<'de> {
    line: &'de [u8],
    at: usize,
}

impl<'de> Cursor<'de> {
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.line.get(self.at).copied()
    }

    /// Past JSON whitespace.
    #[inline]
    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r' | b'\n')) {
            self.at += 1;
        }
    }

    /// Past `byte`, after any whitespace, when it is next.
    #[inline]
    fn eat(&mut self, byte: u8) -> bool {
        if self.peek() != Some(byte) {
            self.space();
            if self.peek() != Some(byte) {
                return false;
            }
        }
        self.at += 1;
        true
    }

    /// An ASCII string without escapes or control characters (anything else: `None`, for
    /// serde_json).
    #[inline]
    fn string(&mut self) -> Option<&'de [u8]> {
        if !self.eat(b'"') {
            return None;
        }
        let start = self.at;
        let len = self.line[start..].iter().position(|&b| b == b'"' || b == b'\\' || !(0x20..0x80).contains(&b))?;
        self.at = start + len;
        if self.line[self.at] != b'"' {
            return None;
        }
        self.at += 1;
        Some(&self.line[start..start + len])
    }

    /// An unsigned integer as serde_json reads one into a u64: no sign, fraction, exponent or
    /// leading zero, at most u64::MAX (anything else: `None`, for serde_json).
    #[inline(always)]
    fn uint(&mut self) -> Option<u64> {
        self.space();
        let start = self.at;
        let rest = self.line.get(start..)?;
        // Up to 19 digits cannot pass u64::MAX (20 digits); more are checked.
        let (mut v, digits) = leading_digits(rest);
        if digits > 19 {
            v = rest[..digits].iter().try_fold(0u64, |v, &d| v.checked_mul(10)?.checked_add(u64::from(d - b'0')))?;
        }
        self.at = start + digits;
        if digits == 0 || (digits > 1 && rest[0] == b'0') || matches!(rest.get(digits), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        Some(v)
    }
}

/// The digits eight bytes (the first in the low byte) start with, when fewer than eight: their
/// value and count (0 digits: `(0, 0)`); `None` when all eight are digits.
#[inline(always)]
fn short_digits(word: u64) -> Option<(u64, usize)> {
    const LOW: u64 = u64::from_le_bytes([0x0f; 8]);
    const HIGH: u64 = u64::from_le_bytes([0xf0; 8]);
    const ZEROS: u64 = u64::from_le_bytes([b'0'; 8]);
    const SIXES: u64 = u64::from_le_bytes([0x06; 8]);
    // Non-zero in each byte that is no digit: its high nibble, or that of the byte plus 6
    // (which passes 0x39), is not 3. A carry out of a byte only reaches the bytes after it.
    let other = ((word & HIGH) ^ ZEROS) | ((word.wrapping_add(SIXES) & HIGH) ^ ZEROS);
    if other == 0 {
        return None;
    }
    let digits = (other.trailing_zeros() / 8) as usize;
    if digits == 0 {
        return Some((0, 0));
    }
    // The digits moved to the top bytes, so the bytes before them read as leading zeros;
    // then pairs, fours and eights of digits are combined.
    let v = (word & LOW) << (8 * (8 - digits));
    let v = (v.wrapping_mul(1 + (10 << 8))) >> 8;
    let v = ((v & 0x00ff_00ff_00ff_00ff).wrapping_mul(1 + (100 << 16))) >> 16;
    let v = ((v & 0x0000_ffff_0000_ffff).wrapping_mul(1 + (10_000 << 32))) >> 32;
    Some((v, digits))
}

/// The decimal digits `text` starts with: their value (wrapped past `u64::MAX`) and count. A
/// number of at most seven digits is read eight bytes at a time.
#[inline(always)]
fn leading_digits(text: &[u8]) -> (u64, usize) {
    if let Some(found) = text.first_chunk::<8>().and_then(|w| short_digits(u64::from_le_bytes(*w))) {
        return found;
    }
    let mut v = 0u64;
    let mut digits = 0;
    for &d in text {
        if !d.is_ascii_digit() {
            break;
        }
        v = v.wrapping_mul(10).wrapping_add(u64::from(d - b'0'));
        digits += 1;
    }
    (v, digits)
}

struct EventVisitor<'b> {
    bufs: &'b mut ListBuffers,
    caps: ListCaps,
}

impl<'de> Visitor<'de> for EventVisitor<'_> {
    type Value = RawEvent<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a trace event (one JSON object)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawEvent<'de>, A::Error> {
        let mut raw = RawEvent { values: Default::default(), duplicate: None };
        while let Some(field) = map.next_key::<Field>()? {
            if field == Field::Other || raw.values[field as usize].is_some() {
                if field != Field::Other && raw.duplicate.is_none() {
                    raw.duplicate = Some(field);
                }
                map.next_value::<Skip>()?;
                continue;
            }
            let (list, cap) = match field {
                Field::Pages => (Some(&mut self.bufs.pages), self.caps.keep()),
                Field::Slots => (Some(&mut self.bufs.slots), SLOTS_KEPT),
                Field::Reserved => (Some(&mut self.bufs.reserved), self.caps.pages),
                _ => (None, 0),
            };
            let value = map.next_value_seed(ValueSeed { list, cap })?;
            raw.values[field as usize] = Some(value);
        }
        Ok(raw)
    }
}

/// Takes any JSON value; a list goes into `list` when the field has one.
struct ValueSeed<'b> {
    list: Option<&'b mut Vec<u64>>,
    cap: u64,
}

impl<'de> DeserializeSeed<'de> for ValueSeed<'_> {
    type Value = Value<'de>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value<'de>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_> {
    type Value = Value<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value<'de>, E> {
        Ok(Value::Uint(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value<'de>, E> {
        Ok(u64::try_from(v).map_or(Value::Other(Found::Negative), Value::Uint))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Value<'de>, E> {
        Ok(Value::Other(Found::NotU64))
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value<'de>, E> {
        Ok(Value::Bool(v))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Value<'de>, E> {
        Ok(Value::Other(Found::Null))
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Value<'de>, E> {
        Ok(Value::Text(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value<'de>, E> {
        Ok(Value::Text(Cow::Owned(v.to_owned())))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value<'de>, A::Error> {
        while map.next_entry::<Skip, Skip>()?.is_some() {}
        Ok(Value::Other(Found::Object))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value<'de>, A::Error> {
        let Some(list) = self.list else {
            while seq.next_element::<Skip>()?.is_some() {}
            return Ok(Value::Other(Found::List));
        };
        let (mut len, mut bad) = (0u64, false);
        while let Some(element) = seq.next_element_seed(ElementSeed)? {
            len = len.saturating_add(1);
            match element {
                Some(v) if (list.len() as u64) < self.cap => list.push(v),
                Some(_) => {}
                None => bad = true,
            }
        }
        Ok(Value::List { len, bad })
    }
}

/// A value the parser does not use, read through (strings checked as UTF-8, nesting limited),
/// never kept.
struct Skip;

impl<'de> de::Deserialize<'de> for Skip {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Skip, D::Error> {
        d.deserialize_any(Skip)
    }
}

impl<'de> Visitor<'de> for Skip {
    type Value = Skip;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Skip, E> {
        Ok(Skip)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Skip, A::Error> {
        while map.next_entry::<Skip, Skip>()?.is_some() {}
        Ok(Skip)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Skip, A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(Skip)
    }
}

/// One list element: `Some` for a `u64`, `None` (consumed) for anything else.
struct ElementSeed;

impl<'de> DeserializeSeed<'de> for ElementSeed {
    type Value = Option<u64>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ElementSeed {
    type Value = Option<u64>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an unsigned integer")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Option<u64>, E> {
        Ok(Some(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Option<u64>, E> {
        Ok(u64::try_from(v).ok())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Option<u64>, E> {
        Ok(None)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Option<u64>, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Option<u64>, E> {
        Ok(None)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Option<u64>, E> {
        Ok(None)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<u64>, A::Error> {
        while map.next_entry::<Skip, Skip>()?.is_some() {}
        Ok(None)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<u64>, A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(None)
    }
}

fn found(value: &Value<'_>) -> Found {
    match value {
        Value::Uint(_) => Found::Uint,
        Value::Bool(_) => Found::Bool,
        Value::Text(_) => Found::Text,
        Value::List { bad: true, .. } => Found::ListOfOther,
        Value::List { .. } => Found::List,
        Value::Other(f) => *f,
    }
}

/// A page id from the trace as the table sees it: ids beyond `u32` become `u32::MAX`, which no
/// pool has (the table then reports `page_out_of_range`).
fn page_id(v: u64) -> PageId {
    PageId(u32::try_from(v).unwrap_or(u32::MAX))
}

/// A parsed, checked event, and the first page id in it beyond `u32` (for the report).
pub(crate) struct Parsed<'a> {
    pub event: Event<'a>,
    pub wide_page: Option<u64>,
    /// A `write`'s slots, when one is beyond `u32` (the event holds them saturated).
    pub wide_slots: Option<(u64, u64)>,
}

impl<'de> RawEvent<'de> {
    fn value(&self, f: Field) -> Option<&Value<'de>> {
        self.values[f as usize].as_ref()
    }

    /// The event the line names.
    pub fn kind(&self) -> Result<EventKind, ReplayErrorKind> {
        match self.value(Field::Ev) {
            None => Err(ReplayErrorKind::MissingEvent),
            Some(Value::Text(name)) => EventKind::from_name(name).ok_or_else(|| {
                let shown: String = name.chars().take(64).collect();
                ReplayErrorKind::UnknownEvent(shown)
            }),
            Some(v) => Err(ReplayErrorKind::WrongType { ev: "?", field: "ev", expected: "a string", found: found(v) }),
        }
    }

    /// Elements in list field `f` as the line wrote it (0 when it is no list).
    fn list_len(&self, f: Field) -> u64 {
        match self.value(f) {
            Some(Value::List { len, .. }) => *len,
            _ => 0,
        }
    }

    /// Checks the fields `kind` needs and builds the event; page lists longer than `caps` allow
    /// are refused. `ids` is a reused buffer for the page list.
    pub fn event<'a>(
        &'a self,
        kind: EventKind,
        bufs: &'a ListBuffers,
        ids: &'a mut Vec<PageId>,
        caps: ListCaps,
    ) -> Result<Parsed<'a>, ReplayErrorKind> {
        let ev = kind.as_str();
        if let Some(f) = self.duplicate {
            return Err(ReplayErrorKind::DuplicateField(f.name()));
        }
        let wrong = |field: Field, expected, v: &Value<'_>| ReplayErrorKind::WrongType {
            ev,
            field: field.name(),
            expected,
            found: found(v),
        };
        let missing = |field: Field| ReplayErrorKind::MissingField { ev, field: field.name() };
        let uint = |field: Field| match self.value(field) {
            Some(Value::Uint(v)) => Ok(*v),
            Some(v) => Err(wrong(field, "an unsigned integer", v)),
            None => Err(missing(field)),
        };
        let text = |field: Field| match self.value(field) {
            Some(Value::Text(s)) => Ok(Cow::Borrowed(&**s)),
            Some(v) => Err(wrong(field, "a string", v)),
            None => Err(missing(field)),
        };
        // A list of unsigned integers, any length: the elements kept.
        let any_list = |field: Field, buf: &'a [u64]| match self.value(field) {
            Some(Value::List { bad: false, .. }) => Ok(buf),
            Some(v) => Err(wrong(field, "a list of unsigned integers", v)),
            None => Err(missing(field)),
        };
        // A page list of at most `caps.pages` elements.
        let list = |field: Field, buf: &'a [u64]| {
            let buf = any_list(field, buf)?;
            let len = self.list_len(field);
            if len > caps.pages {
                return Err(ReplayErrorKind::ListTooLong { ev, field: field.name(), len, max: caps.pages });
            }
            Ok(buf)
        };
        let mut wide_page = None;
        let mut wide_slots = None;
        let mut pages = |src: &[u64], ids: &'a mut Vec<PageId>| -> Cow<'a, [PageId]> {
            ids.clear();
            // Two plain passes the compiler vectorizes: the ids saturated, then a look for wide ones.
            ids.extend(src.iter().map(|&p| PageId(p.min(u64::from(u32::MAX)) as u32)));
            if src.iter().any(|&p| p > u64::from(u32::MAX)) {
                wide_page = src.iter().copied().find(|&p| p > u64::from(u32::MAX));
            }
            Cow::Borrowed(&ids[..])
        };
        let req = || uint(Field::Req).map(RequestId);

        let event = match kind {
            EventKind::Pool => {
                let n = uint(Field::Pages)?;
                let pages_u32 = u32::try_from(n)
                    .map_err(|_| ReplayErrorKind::PoolTooLarge { pages: n, max: crate::config::MAX_PAGES })?;
                let page_size = uint(Field::PageSize)?;
                let page_size = u32::try_from(page_size).map_err(|_| {
                    ReplayErrorKind::InvalidPool(crate::config::ConfigError::PageSize {
                        page_size: u32::MAX,
                        max: crate::config::MAX_PAGE_SIZE,
                    })
                })?;
                let max_context = uint(Field::MaxContext)?;
                let version = match self.value(Field::Version) {
                    None => None,
                    Some(_) => Some(text(Field::Version)?),
                };
                let scrub_on_release = match self.value(Field::ScrubOnRelease) {
                    None => false,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => return Err(wrong(Field::ScrubOnRelease, "true or false", v)),
                };
                // No valid pool reserves more pages than it has.
                if self.list_len(Field::Reserved) > n {
                    let len = self.list_len(Field::Reserved);
                    return Err(ReplayErrorKind::ListTooLong { ev, field: Field::Reserved.name(), len, max: n });
                }
                let reserved = match self.value(Field::Reserved) {
                    None => Cow::Borrowed(&[][..]),
                    Some(_) => pages(list(Field::Reserved, &bufs.reserved)?, ids),
                };
                Event::Pool { pages: pages_u32, page_size, max_context, reserved, version, scrub_on_release }
            }
            EventKind::Admit => Event::Admit {
                req: req()?,
                tenant: text(Field::Tenant)?,
                prompt: uint(Field::Prompt)?,
                max_new: uint(Field::MaxNew)?,
            },
            EventKind::Alloc => Event::Alloc { req: req()?, pages: pages(list(Field::Pages, &bufs.pages)?, ids) },
            EventKind::Write => {
                let req = req()?;
                let page = uint(Field::Page)?;
                if page > u64::from(u32::MAX) {
                    wide_page = Some(page);
                }
                let slots = match self.value(Field::Slots) {
                    Some(Value::List { bad: false, .. }) => &bufs.slots[..],
                    Some(v) => return Err(wrong(Field::Slots, "a pair [a,b] of unsigned integers", v)),
                    None => return Err(missing(Field::Slots)),
                };
                let len = self.list_len(Field::Slots);
                let (SLOTS_KEPT, &[a, b]) = (len, slots) else {
                    return Err(ReplayErrorKind::SlotsNotPair { ev, len });
                };
                if a > u64::from(u32::MAX) || b > u64::from(u32::MAX) {
                    wide_slots = Some((a, b));
                }
                let slot = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
                Event::Write { req, page: page_id(page), slots: [slot(a), slot(b)] }
            }
            EventKind::Read => {
                let req = req()?;
                let kept = any_list(Field::Pages, &bufs.pages)?;
                let tokens = uint(Field::Tokens)?;
                let len = self.list_len(Field::Pages);
                // Padding past the kept entries is never read: judge the read on those, unless its
                // tokens run past them.
                if len > caps.read {
                    let max = caps.read;
                    match caps.page_size {
                        0 => return Err(ReplayErrorKind::ListTooLong { ev, field: Field::Pages.name(), len, max }),
                        ps if tokens.div_ceil(ps) > max => {
                            return Err(ReplayErrorKind::ReadTooLong { len, tokens, max });
                        }
                        _ => {}
                    }
                }
                let kept = &kept[..kept.len().min(usize::try_from(caps.read).unwrap_or(usize::MAX))];
                Event::Read { req, pages: pages(kept, ids), tokens }
            }
            EventKind::Free => {
                let req = req()?;
                match self.value(Field::Pages) {
                    None => Event::Free { req, pages: None },
                    Some(_) => Event::Free { req, pages: Some(pages(list(Field::Pages, &bufs.pages)?, ids)) },
                }
            }
            EventKind::Share => Event::Share {
                req: req()?,
                key: text(Field::Key)?,
                pages: pages(list(Field::Pages, &bufs.pages)?, ids),
            },
            EventKind::Attach => Event::Attach { req: req()?, key: text(Field::Key)? },
            EventKind::Evict => Event::Evict { key: text(Field::Key)? },
            EventKind::Import => Event::Import {
                req: req()?,
                pages: pages(list(Field::Pages, &bufs.pages)?, ids),
                tokens: uint(Field::Tokens)?,
                expect: uint(Field::Expect)?,
            },
            EventKind::Fork => Event::Fork { req: req()?, child: uint(Field::Child).map(RequestId)? },
            EventKind::Detach => Event::Detach { req: req()?, key: text(Field::Key)? },
            EventKind::Preempt => Event::Preempt { req: req()? },
            EventKind::Scrub => Event::Scrub { pages: pages(list(Field::Pages, &bufs.pages)?, ids) },
            EventKind::Grant => Event::Grant { tenant: text(Field::Tenant)? },
            EventKind::Revoke => Event::Revoke { tenant: text(Field::Tenant)? },
            EventKind::End => Event::End,
        };
        Ok(Parsed { event, wide_page, wide_slots })
    }
}

/// A single line read with the format's rules, outside a replay (no pool, so page lists, a
/// `read`'s included, are capped at [`MAX_PAGES`](crate::config::MAX_PAGES) and kept whole).
impl<'de> de::Deserialize<'de> for Event<'static> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Event<'static>, D::Error> {
        let caps = ListCaps::strict(u64::from(crate::config::MAX_PAGES));
        let mut bufs = ListBuffers::default();
        let raw = d.deserialize_map(EventVisitor { bufs: &mut bufs, caps })?;
        let kind = raw.kind().map_err(de::Error::custom)?;
        let mut ids = Vec::new();
        let parsed = raw.event(kind, &bufs, &mut ids, caps).map_err(de::Error::custom)?;
        Ok(parsed.event.into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parse's outcome as text: each field's value, the kept lists, or the error.
    fn shown(outcome: Result<RawEvent<'_>, ReplayErrorKind>, bufs: &ListBuffers) -> String {
        match outcome {
            Ok(raw) => format!("{:?} {:?} {:?}", raw.values, raw.duplicate, bufs),
            Err(e) => format!("error {e:?}"),
        }
    }

    #[test]
    fn the_fast_path_reads_each_line_as_serde_json_does() {
        let lines = [
            r#"{"ev":"read","req":7,"pages":[1,2,3],"tokens":40}"#,
            r#"{"ev":"read","req":7,"pages":[1 ,2, 3,18446744073709551615],"tokens":40}"#,
            r#"{"ev":"read","req":7,"pages":[1,99999999999999999999],"tokens":40}"#,
            r#"{"ev":"read","req":7,"pages":[1,02],"tokens":40}"#,
            r#"{"ev":"read","req":7,"pages":[1,2,],"tokens":40}"#,
            r#"{"ev":"read","req":7,"pages":[1,2"#,
            r#" { "ev" : "write" , "req" : 7 , "page" : 3 , "slots" : [ 0 , 16 ] } "#,
            r#"{"ev":"admit","req":18446744073709551615,"tenant":"acme","prompt":0,"max_new":1}"#,
            r#"{"ev":"admit","req":18446744073709551616,"tenant":"acme"}"#,
            r#"{"ev":"admit","req":007,"tenant":"acme"}"#,
            r#"{"ev":"admit","req":-7,"tenant":"acme"}"#,
            r#"{"ev":"admit","req":7.0,"tenant":"acme"}"#,
            r#"{"ev":"admit","req":7e2,"tenant":"acme"}"#,
            r#"{"ev":"admit","req":7,"tenant":"a"b"}"#,
            r#"{"ev":"admit","req":7,"tenant":"é"}"#,
            r#"{"ev":"admit","req":7,"req":8}"#,
            r#"{"ev":"admit","req":7,"other":{"a":[1,{"b":2}]}}"#,
            r#"{"ev":"pool","pages":8,"page_size":16,"max_context":64,"reserved":[0],"scrub_on_release":true}"#,
            r#"{"ev":"pool","pages":8,"scrub_on_release":false,"version":"1.1"}"#,
            r#"{"ev":"read","req":7,"pages":[1,-2,3.5,"x"],"tokens":40}"#,
            r#"{"ev":"read","req":7,"pages":[],"tokens":0}"#,
            r#"{"ev":"read","req":7,"pages":[1,2,],"tokens":0}"#,
            r#"{"ev":"read","req":7,"tokens":[1]}"#,
            r#"{"ev":"free","req":7} x"#,
            r#"{"ev":"free","req":7,}"#,
            r#"{"ev":"free","req":7"#,
            r#"{"ev":"free","req":null}"#,
            r#"{"ev":"free","req":tru}"#,
            r#"{}"#,
            r#"[1]"#,
            r#"{"ev":"write","req":1,"page":2,"slots":[0,1,2,3]}"#,
            r#"{"ev":"nope","req":1}"#,
            r#"{"ev":"Read","req":1}"#,
            r#"{"tenant":"read","ev":"admit","req":7}"#,
            r#"{"ev":"free","req":1234567}"#,
            r#"{"ev":"free","req":1234567.5}"#,
            r#"{"ev":"free","req":0123456}"#,
            r#"{"ev":"free","req":12345678}"#,
            r#"{"ev":"free","req":7e}"#,
        ];
        for line in lines {
            let (mut fast, mut reference) = (ListBuffers::default(), ListBuffers::default());
            let caps = ListCaps::strict(2);
            let got = shown(parse_line(line.as_bytes(), &mut fast, caps), &fast);
            let want = shown(parse_json(line.as_bytes(), &mut reference, caps), &reference);
            assert_eq!(got, want, "{line}");
        }
    }

    #[test]
    fn the_fast_path_matches_serde_json_on_random_lines() {
        let tokens = [
            "{",
            "}",
            "[",
            "]",
            ":",
            ",",
            " ",
            "\"ev\"",
            "\"read\"",
            "\"req\"",
            "\"pages\"",
            "\"slots\"",
            "\"tokens\"",
            "\"reserved\"",
            "\"x\"",
            "true",
            "false",
            "null",
            "-",
            ".",
            "e",
            "0",
            "00",
            "7",
            "12",
            "4294967296",
            "18446744073709551615",
            "18446744073709551616",
            "99999999",
            "1234567",
            "\"a\\\"b\"",
        ];
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |m: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % m as u64) as usize
        };
        for _ in 0..20_000 {
            // Mostly well-formed events, a token or two changed.
            let mut line = String::from("{\"ev\":\"read\",\"req\":");
            line.push_str(tokens[21 + next(10)]);
            line.push_str(",\"pages\":[");
            for i in 0..next(12) {
                if i > 0 {
                    line.push(',');
                }
                line.push_str(tokens[21 + next(10)]);
            }
            line.push_str("],\"tokens\":7}");
            for _ in 0..next(3) {
                let at = next(line.len() + 1);
                if line.is_char_boundary(at) {
                    line.insert_str(at, tokens[next(tokens.len())]);
                }
            }
            let (mut fast, mut reference) = (ListBuffers::default(), ListBuffers::default());
            let caps = ListCaps::strict(6);
            let got = shown(parse_line(line.as_bytes(), &mut fast, caps), &fast);
            let want = shown(parse_json(line.as_bytes(), &mut reference, caps), &reference);
            assert_eq!(got, want, "{line}");
        }
    }

    fn parse(line: &str) -> Result<Event<'static>, ReplayErrorKind> {
        let mut bufs = ListBuffers::default();
        let mut ids = Vec::new();
        let raw = parse_line(line.as_bytes(), &mut bufs, ListCaps::strict(1000))?;
        let kind = raw.kind()?;
        let parsed = raw.event(kind, &bufs, &mut ids, ListCaps::strict(1000))?;
        Ok(parsed.event.into_owned())
    }

    #[test]
    fn leading_digits_are_read_at_any_length() {
        for n in 0..=20usize {
            let digits: String = (0..n).map(|i| char::from(b'1' + (i % 9) as u8)).collect();
            for tail in ["", ",", "]", "}", ",1,2,3,4,5,6,7,8", "\u{ff}xxxxxxxx", "\u{fa}:::::::"] {
                let text = format!("{digits}{tail}");
                let want = digits.bytes().fold(0u64, |v, d| v.wrapping_mul(10).wrapping_add(u64::from(d - b'0')));
                assert_eq!(leading_digits(text.as_bytes()), (want, n), "{text:?}");
            }
        }
        for b in 0..=255u8 {
            let text = [b, b'7', b'7', b'7', b'7', b'7', b'7', b'7', b'7'];
            let want = if b.is_ascii_digit() { (u64::from(b - b'0') * 100_000_000 + 77_777_777, 9) } else { (0, 0) };
            assert_eq!(leading_digits(&text), want, "{b}");
            let text = [b'4', b'2', b, b'7', b'7', b'7', b'7', b'7', b'7'];
            if !b.is_ascii_digit() {
                assert_eq!(leading_digits(&text), (42, 2), "{b}");
            }
        }
    }

    #[test]
    fn field_names_round_trip() {
        let all = [
            Field::Ev,
            Field::Req,
            Field::Tenant,
            Field::Prompt,
            Field::MaxNew,
            Field::Pages,
            Field::Page,
            Field::Slots,
            Field::Tokens,
            Field::Key,
            Field::Expect,
            Field::Child,
            Field::PageSize,
            Field::MaxContext,
            Field::Reserved,
            Field::Version,
            Field::ScrubOnRelease,
        ];
        assert_eq!(all.len(), Field::COUNT);
        for f in all {
            assert_eq!(Field::from_bytes(f.name().as_bytes()), f);
        }
        assert_eq!(Field::from_bytes(b"pagez"), Field::Other);
        for &k in EventKind::ALL {
            assert_eq!(EventKind::from_name(k.as_str()), Some(k));
        }
        assert_eq!(EventKind::from_name("reads"), None);
    }

    #[test]
    fn fields_in_any_order_and_unknown_fields_are_ignored() {
        let e = parse(r#"{"tokens":20,"extra":{"a":[1,2]},"pages":[3,4],"ev":"read","req":1,"tenant":5}"#).unwrap();
        assert_eq!(e, Event::Read { req: RequestId(1), pages: vec![PageId(3), PageId(4)].into(), tokens: 20 });
    }

    #[test]
    fn escaped_strings_are_read() {
        let e = parse(r#"{"ev":"attach","req":1,"key":"a\"b\u00e9"}"#).unwrap();
        assert_eq!(e, Event::Attach { req: RequestId(1), key: "a\"bé".into() });
    }

    #[test]
    fn wrong_types_name_the_field_and_what_was_found() {
        let cases = [
            (r#"{"ev":"free","req":-1}"#, Found::Negative),
            (r#"{"ev":"free","req":1.5}"#, Found::NotU64),
            (r#"{"ev":"free","req":18446744073709551616}"#, Found::NotU64),
            (r#"{"ev":"free","req":"1"}"#, Found::Text),
            (r#"{"ev":"free","req":null}"#, Found::Null),
            (r#"{"ev":"free","req":1,"pages":[1,-2]}"#, Found::ListOfOther),
            (r#"{"ev":"free","req":1,"pages":4}"#, Found::Uint),
        ];
        for (line, want) in cases {
            match parse(line) {
                Err(ReplayErrorKind::WrongType { found, .. }) => assert_eq!(found, want, "{line}"),
                other => panic!("{line}: {other:?}"),
            }
        }
    }

    #[test]
    fn malformed_lines_are_typed() {
        assert!(matches!(parse("[1,2]"), Err(ReplayErrorKind::Json(_))));
        assert!(matches!(parse("5"), Err(ReplayErrorKind::Json(_))));
        assert!(matches!(parse(r#"{"ev":"read""#), Err(ReplayErrorKind::Json(_))));
        assert!(matches!(parse(r#"{"ev":"evict","key":"k"} x"#), Err(ReplayErrorKind::Json(_))));
        assert!(matches!(parse(r#"{"req":1}"#), Err(ReplayErrorKind::MissingEvent)));
        assert!(matches!(parse(r#"{"ev":"launch"}"#), Err(ReplayErrorKind::UnknownEvent(_))));
        assert!(matches!(parse(r#"{"ev":"admit","req":1}"#), Err(ReplayErrorKind::MissingField { .. })));
        assert!(matches!(parse(r#"{"ev":"fork","req":1,"req":2,"child":3}"#), Err(ReplayErrorKind::DuplicateField(_))));
        assert!(matches!(
            parse(r#"{"ev":"write","req":1,"page":2,"slots":[1,2,3]}"#),
            Err(ReplayErrorKind::SlotsNotPair { len: 3, .. })
        ));
        let mut bufs = ListBuffers::default();
        assert!(matches!(
            parse_line(b"{\"ev\":\"evict\",\"key\":\"\xff\"}", &mut bufs, ListCaps::strict(8)),
            Err(ReplayErrorKind::Json(_))
        ));
    }

    #[test]
    fn long_lists_are_refused_without_keeping_them() {
        let line = format!(r#"{{"ev":"alloc","req":1,"pages":[{}]}}"#, vec!["7"; 5000].join(","));
        let mut bufs = ListBuffers::default();
        let raw = parse_line(line.as_bytes(), &mut bufs, ListCaps::strict(100)).unwrap();
        assert_eq!(bufs.pages.len(), 100);
        let mut ids = Vec::new();
        assert!(matches!(
            raw.event(EventKind::Alloc, &bufs, &mut ids, ListCaps::strict(100)),
            Err(ReplayErrorKind::ListTooLong { len: 5000, max: 100, .. })
        ));
    }

    #[test]
    fn slots_have_their_own_cap_whatever_the_pool() {
        let caps = ListCaps::strict(1);
        let mut bufs = ListBuffers::default();
        let mut ids = Vec::new();
        let raw = parse_line(br#"{"ev":"write","req":1,"page":0,"slots":[0,16]}"#, &mut bufs, caps).unwrap();
        let parsed = raw.event(EventKind::Write, &bufs, &mut ids, caps).unwrap();
        assert_eq!(parsed.event, Event::Write { req: RequestId(1), page: PageId(0), slots: [0, 16] });
        let line = format!(r#"{{"ev":"write","req":1,"page":0,"slots":[{}]}}"#, vec!["1"; 300].join(","));
        let raw = parse_line(line.as_bytes(), &mut bufs, caps).unwrap();
        assert_eq!(bufs.slots.len(), 2);
        assert!(matches!(
            raw.event(EventKind::Write, &bufs, &mut ids, caps),
            Err(ReplayErrorKind::SlotsNotPair { len: 300, .. })
        ));
    }

    #[test]
    fn read_padding_is_kept_up_to_the_read_cap() {
        let caps = ListCaps { pages: 4, read: 6, page_size: 16 };
        let mut bufs = ListBuffers::default();
        let mut ids = Vec::new();
        let line =
            |tokens: u64| format!(r#"{{"ev":"read","req":1,"pages":[1,2{}],"tokens":{tokens}}}"#, ",0".repeat(98));
        let text = line(96);
        let raw = parse_line(text.as_bytes(), &mut bufs, caps).unwrap();
        assert_eq!(bufs.pages.len(), 6);
        let parsed = raw.event(EventKind::Read, &bufs, &mut ids, caps).unwrap();
        assert!(matches!(parsed.event, Event::Read { ref pages, tokens: 96, .. } if pages.len() == 6));
        let text = line(97);
        let raw = parse_line(text.as_bytes(), &mut bufs, caps).unwrap();
        assert!(matches!(
            raw.event(EventKind::Read, &bufs, &mut ids, caps),
            Err(ReplayErrorKind::ReadTooLong { len: 100, tokens: 97, max: 6 })
        ));
        // Other page lists keep the pool's cap.
        let raw = parse_line(br#"{"ev":"alloc","req":1,"pages":[1,2,3,4,5]}"#, &mut bufs, caps).unwrap();
        assert!(matches!(
            raw.event(EventKind::Alloc, &bufs, &mut ids, caps),
            Err(ReplayErrorKind::ListTooLong { len: 5, max: 4, .. })
        ));
        // Outside a replay (no page size) a long read is refused whole.
        let caps = ListCaps::strict(4);
        let raw = parse_line(br#"{"ev":"read","req":1,"pages":[1,2,3,4,5],"tokens":1}"#, &mut bufs, caps).unwrap();
        assert!(matches!(
            raw.event(EventKind::Read, &bufs, &mut ids, caps),
            Err(ReplayErrorKind::ListTooLong { len: 5, max: 4, .. })
        ));
    }

    #[test]
    fn wide_page_ids_are_kept_for_the_report() {
        let mut bufs = ListBuffers::default();
        let mut ids = Vec::new();
        let caps = ListCaps::strict(10);
        let raw = parse_line(br#"{"ev":"read","req":1,"pages":[2,5000000000],"tokens":3}"#, &mut bufs, caps).unwrap();
        let parsed = raw.event(EventKind::Read, &bufs, &mut ids, caps).unwrap();
        assert_eq!(parsed.wide_page, Some(5_000_000_000));
        assert!(matches!(parsed.event, Event::Read { ref pages, .. } if pages[1] == PageId(u32::MAX)));
    }
}
