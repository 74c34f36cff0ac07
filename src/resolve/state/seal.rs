//! The seal of an SQLite flow state: one digest over everything the continuity check trusts
//! the file for (every principal's label, every spent grant, the records checkpoint), kept in
//! the file and rewritten in the same transaction as each of them.
//!
//! SQLite keeps a table's pages in the database file and, until they are moved there, in the
//! write-ahead log beside it; the log does not name the file it belongs to. An older
//! `state.db` restored while a later run's `-wal` is left beside it (or copied over the file
//! of a running host) is read as a mix of pages from different times: a current checkpoint
//! over older labels would pass the records check, since the records after that checkpoint
//! need not prove the labels the older copy lacks. The seal is one row: from whatever time
//! its page comes, the labels, grants and checkpoint read with it only match it if they come
//! from that same time.
//!
//! The digest is a sum modulo 2^256 of one SHA-256 per item, so each write adjusts it by the
//! items it changes instead of hashing the whole table again. It detects pages mixed by
//! accident; it is no protection against someone who can write the file (they could write
//! any labels, and the seal to match).

use sha2::{Digest, Sha256};

use crate::ident::PrincipalId;
use crate::label::InformationLabel;

/// Separates this digest's items from any other SHA-256 input.
const DOMAIN: &[u8] = b"flowhost flow-state seal v1\0";

/// A digest of a flow state's sealed contents (see the module documentation). Equal
/// contents always give equal seals, whatever order they were written in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Seal([u64; 4]);

/// One item's contribution: SHA-256 over the domain, the item's kind and its
/// length-prefixed parts, read as a 256-bit number (four little-endian limbs).
fn item(kind: u8, parts: &[&[u8]]) -> [u64; 4] {
    let mut h = Sha256::new();
    h.update(DOMAIN);
    h.update([kind]);
    for part in parts {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    let bytes = h.finalize();
    let mut limbs = [0u64; 4];
    for (limb, chunk) in limbs.iter_mut().zip(bytes.chunks_exact(8)) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        *limb = u64::from_le_bytes(word);
    }
    limbs
}

impl Seal {
    fn add(&mut self, x: [u64; 4]) {
        let mut carry = false;
        for (a, b) in self.0.iter_mut().zip(x) {
            let (s, c1) = a.overflowing_add(b);
            let (s, c2) = s.overflowing_add(u64::from(carry));
            *a = s;
            carry = c1 || c2;
        }
    }

    /// Subtracts `x`: adds its two's complement.
    fn sub(&mut self, x: [u64; 4]) {
        let mut negated = Seal(x.map(|limb| !limb));
        negated.add([1, 0, 0, 0]);
        self.add(negated.0);
    }

    /// A principal's label, given as its canonical JSON. Bottom contributes nothing, so a
    /// principal stored at bottom and one not stored (which reads as bottom) seal alike.
    fn principal_item(principal: &PrincipalId, label: &InformationLabel) -> Option<[u64; 4]> {
        (!label.is_bottom()).then(|| {
            item(
                b'p',
                &[
                    principal.as_str().as_bytes(),
                    label.to_canonical_json().as_bytes(),
                ],
            )
        })
    }

    /// Replaces `principal`'s label `old` by `new` in the seal.
    pub(super) fn relabel(
        &mut self,
        principal: &PrincipalId,
        old: &InformationLabel,
        new: &InformationLabel,
    ) {
        if let Some(x) = Self::principal_item(principal, old) {
            self.sub(x);
        }
        if let Some(x) = Self::principal_item(principal, new) {
            self.add(x);
        }
    }

    /// Adds grant `id`, newly spent.
    pub(super) fn spend(&mut self, id: &str) {
        self.add(item(b'g', &[id.as_bytes()]));
    }

    /// Replaces the records checkpoint `old` by `new`.
    pub(super) fn rebind(&mut self, old: Option<(i64, &str)>, new: (i64, &str)) {
        let checkpoint =
            |(seq, hash): (i64, &str)| item(b'c', &[&seq.to_be_bytes(), hash.as_bytes()]);
        if let Some(old) = old {
            self.sub(checkpoint(old));
        }
        self.add(checkpoint(new));
    }

    /// The seal as stored: 64 hexadecimal digits.
    pub(super) fn to_hex(self) -> String {
        self.0
            .iter()
            .rev()
            .map(|limb| format!("{limb:016x}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::owner;
    use super::*;

    /// The seal depends on what is held, not on the order it was written in, and a change
    /// undone leaves it as it was.
    #[test]
    fn equal_contents_seal_alike_whatever_the_order_of_writes() {
        let (alice, bob) = (
            PrincipalId::new("alice").unwrap(),
            PrincipalId::new("bob").unwrap(),
        );
        let bottom = InformationLabel::bottom();
        let mut one = Seal::default();
        one.relabel(&alice, &bottom, &owner("x"));
        one.spend("g-1");
        one.rebind(None, (3, "aa"));
        one.relabel(&bob, &bottom, &owner("y"));
        one.rebind(Some((3, "aa")), (9, "bb"));
        let mut two = Seal::default();
        two.rebind(None, (9, "bb"));
        two.relabel(&bob, &bottom, &owner("z"));
        two.relabel(&bob, &owner("z"), &owner("y"));
        two.spend("g-1");
        two.relabel(&alice, &bottom, &owner("x"));
        assert_eq!(one, two);
        assert_eq!(one.to_hex().len(), 64);
        let mut three = one;
        three.spend("g-2");
        assert_ne!(three, one);
        let mut four = one;
        four.relabel(&alice, &owner("x"), &bottom);
        four.relabel(&alice, &bottom, &owner("x"));
        assert_eq!(four, one);
        // Bottom is the same as nothing stored.
        let mut five = one;
        five.relabel(&PrincipalId::new("carol").unwrap(), &bottom, &bottom);
        assert_eq!(five, one);
    }
}
