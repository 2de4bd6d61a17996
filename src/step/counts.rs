//! A step's per-request token counts (tokens computed before the step, tokens scheduled in it)
//! read in place from the engine's own array: vLLM keeps them as `int32`, a Rust or C caller as
//! `u64`. Reading them where they are spares the step a converted copy, which is memory written
//! cold every step (what a step costs an engine is the lines it touches).

/// Non-negative token counts, one per request of a step ([`EngineStep`](super::EngineStep)),
/// in the engine's own array: `u64`s, or `i32`s checked non-negative when wrapped.
///
/// ```
/// use kvguard::step::Counts;
/// let engine: [i32; 3] = [20, 0, 7]; // vLLM's num_computed_tokens_cpu, int32
/// let counts = Counts::from_i32(&engine)?;
/// assert_eq!(counts.get(2), 7);
/// assert_eq!(counts.iter().sum::<u64>(), 27);
/// assert!(Counts::from_i32(&[3, -1]).is_err()); // names index 1
/// let mine = Counts::from(&[20u64, 0, 7]);
/// assert_eq!(mine, counts);
/// # Ok::<(), kvguard::step::NegativeCount>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Counts<'a>(Repr<'a>);

#[derive(Clone, Copy, Debug)]
pub(crate) enum Repr<'a> {
    U64(&'a [u64]),
    /// Every entry non-negative (checked by [`Counts::from_i32`]).
    I32(&'a [i32]),
}

/// A negative entry in an `i32` count array: no request computed or scheduled fewer than zero
/// tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("count {index} is {value}: token counts are never negative")]
pub struct NegativeCount {
    /// Its index.
    pub index: usize,
    /// Its value.
    pub value: i32,
}

impl<'a> Counts<'a> {
    /// `i32` counts (an engine's int32 array), or the first negative one. One branch-free pass
    /// checks them all.
    pub fn from_i32(values: &'a [i32]) -> Result<Counts<'a>, NegativeCount> {
        if values.iter().fold(false, |neg, &v| neg | (v < 0)) {
            let index = values.iter().position(|&v| v < 0).unwrap_or(0);
            return Err(NegativeCount { index, value: values[index] });
        }
        Ok(Counts(Repr::I32(values)))
    }

    /// The array, as its own type.
    pub(crate) fn repr(&self) -> Repr<'a> {
        self.0
    }

    /// How many.
    pub fn len(&self) -> usize {
        match self.0 {
            Repr::U64(s) => s.len(),
            Repr::I32(s) => s.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Count `i`. Panics past the end, as a slice's index does; the step's callers index
    /// within the length they checked.
    pub fn get(&self, i: usize) -> u64 {
        match self.0 {
            Repr::U64(s) => s[i],
            // Non-negative (checked when wrapped): the cast keeps the value.
            Repr::I32(s) => s[i] as u64,
        }
    }

    /// Every count, in order.
    pub fn iter(&self) -> CountsIter<'a> {
        CountsIter(match self.0 {
            Repr::U64(s) => IterRepr::U64(s.iter()),
            Repr::I32(s) => IterRepr::I32(s.iter()),
        })
    }
}

/// A count's element type: `u64`, or an `i32` known non-negative.
pub(crate) trait Count: Copy {
    /// The count as a `u64`.
    fn count(self) -> u64;
}

impl Count for u64 {
    #[inline(always)]
    fn count(self) -> u64 {
        self
    }
}

impl Count for i32 {
    #[inline(always)]
    fn count(self) -> u64 {
        // Non-negative (checked when wrapped): the cast keeps the value.
        self as u64
    }
}

/// Runs `$body` with `$a` and `$b` bound to two [`Counts`]' own slices (`&[u64]` or `&[i32]`,
/// each [`Count`]): the step's passes over its two count arrays, each a loop over the arrays'
/// own types (one branch on the types, not one a count). `$body` is generic code, compiled
/// once for each pair of types.
macro_rules! with_count_slices {
    ($first:expr, $second:expr, |$a:ident, $b:ident| $body:expr) => {{
        use $crate::step::counts::Repr;
        match ($first.repr(), $second.repr()) {
            (Repr::I32($a), Repr::I32($b)) => $body,
            (Repr::U64($a), Repr::U64($b)) => $body,
            (Repr::I32($a), Repr::U64($b)) => $body,
            (Repr::U64($a), Repr::I32($b)) => $body,
        }
    }};
}
pub(crate) use with_count_slices;

impl<'a> From<&'a [u64]> for Counts<'a> {
    fn from(values: &'a [u64]) -> Counts<'a> {
        Counts(Repr::U64(values))
    }
}

impl<'a, const N: usize> From<&'a [u64; N]> for Counts<'a> {
    fn from(values: &'a [u64; N]) -> Counts<'a> {
        Counts(Repr::U64(values))
    }
}

impl<'a> From<&'a Vec<u64>> for Counts<'a> {
    fn from(values: &'a Vec<u64>) -> Counts<'a> {
        Counts(Repr::U64(values))
    }
}

/// Equal when they hold the same counts, whatever their arrays' types.
impl PartialEq for Counts<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for Counts<'_> {}

impl<'a> IntoIterator for Counts<'a> {
    type Item = u64;
    type IntoIter = CountsIter<'a>;

    fn into_iter(self) -> CountsIter<'a> {
        self.iter()
    }
}

/// The counts of a [`Counts`], as `u64`s.
#[derive(Clone, Debug)]
pub struct CountsIter<'a>(IterRepr<'a>);

#[derive(Clone, Debug)]
enum IterRepr<'a> {
    U64(std::slice::Iter<'a, u64>),
    I32(std::slice::Iter<'a, i32>),
}

impl Iterator for CountsIter<'_> {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        match &mut self.0 {
            IterRepr::U64(it) => it.next().copied(),
            IterRepr::I32(it) => it.next().map(|&v| v as u64),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            IterRepr::U64(it) => it.size_hint(),
            IterRepr::I32(it) => it.size_hint(),
        }
    }
}

impl ExactSizeIterator for CountsIter<'_> {}
