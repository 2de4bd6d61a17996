//! A decode step's row write against a plugin's mirror (`OwnershipTable::write_decode_rows`)
//! beside the rule it stands for, applied position by position with each claim its own call on a
//! second table: what the proptest `a_row_write_judges_as_its_claims_one_by_one`
//! (tests/it/step_mirror.rs) checks, and what the engine-step model (and so the fuzz target
//! `engine_step`) runs after every step on the tables the step left.

use kvguard::step::{DecodeRowWrite, PoolMirror};
use kvguard::{OwnershipTable, PageId, RequestId};

/// A mirror of a pool of `pages` pages (the page arrays one entry longer), right or wrong about
/// the table, and a row write's positions `(row, column, slot)`.
#[derive(Clone, Debug)]
pub struct Mirror {
    pub keys: Vec<i64>,
    pub claimants: Vec<i64>,
    pub prefix: Vec<i64>,
    pub owner: Vec<i64>,
    pub checked: Vec<i64>,
    pub positions: Vec<(u64, i64, i64)>,
}

/// Runs `m`'s row write through `write_decode_rows` on `one` and through the rule on `two` (the
/// two tables alike before), and requires the same claims, verdicts, mirror and pages.
/// `label` names the case in a failure.
pub fn row_write_as_its_claims(one: &OwnershipTable, two: &OwnershipTable, m: &Mirror, label: &str) {
    let pages = one.config().num_pages;
    let ps = i64::from(one.page_size());
    let rows: Vec<u64> = m.positions.iter().map(|p| p.0).collect();
    let cols: Vec<i64> = m.positions.iter().map(|p| p.1).collect();
    let slots: Vec<i64> = m.positions.iter().map(|p| p.2).collect();
    let (mut owner, mut checked) = (m.owner.clone(), m.checked.clone());
    let mirror = PoolMirror::new(&m.keys[..], &m.claimants[..], &m.prefix[..], &owner[..], pages).expect("fits");
    let write = DecodeRowWrite { rows: &rows, cols: &cols[..], slots: &slots[..] };
    let out = one.write_decode_rows(mirror, &mut owner[..], &mut checked[..], write).expect("well formed");

    let never = pages as usize;
    let repeats = (0..rows.len()).any(|i| rows[..i].contains(&rows[i]));
    let (mut want_owner, mut want_checked) = (m.owner.clone(), m.checked.clone());
    let (mut left, mut claims, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    for (i, (&row, &slot)) in rows.iter().zip(&slots).enumerate() {
        let row = row as usize;
        want_checked[row] = want_checked[row].min(cols[i].max(0));
        let key = m.keys[row];
        let page = slot.div_euclid(ps);
        let at = if (0..i64::from(pages)).contains(&page) { page as usize } else { never };
        // The mirror as it was before the step says what a row already owns.
        if at < never && m.owner[at] == key {
            continue;
        }
        if m.claimants[row] == 0 || m.prefix[at] != 0 {
            left.push(i);
            continue;
        }
        let page = PageId(u32::try_from(page).unwrap_or(u32::MAX));
        if repeats && claims.contains(&(RequestId(key as u64), page)) {
            continue;
        }
        claims.push((RequestId(key as u64), page));
        match two.claim(RequestId(key as u64), &[page]) {
            Ok(_) if at < never => want_owner[at] = key,
            Ok(_) => {}
            Err(kvguard::Error::Violation(v)) => refused.push((claims.len() - 1, v.kind())),
            Err(e) => panic!("{label}: a claim failed outside the rules: {e}"),
        }
    }
    assert_eq!(out.left, left, "{label}: left");
    assert_eq!(out.claims.iter().map(|c| (c.request, c.page)).collect::<Vec<_>>(), claims, "{label}: claims");
    let kinds: Vec<_> = out.verdict.refused.iter().map(|(i, v)| (*i, v.kind())).collect();
    assert_eq!(kinds, refused, "{label}: verdict");
    assert_eq!(owner, want_owner, "{label}: page_owner");
    assert_eq!(checked, want_checked, "{label}: row_checked");
    for p in 0..pages {
        assert_eq!(one.page_info(PageId(p)), two.page_info(PageId(p)), "{label}: page {p}");
    }
}
