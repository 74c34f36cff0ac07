//! How many executors each principal's sessions hold at once. A session runs up to
//! [`super::session::MAX_EXECUTORS_PER_SERVER`] executors of each server and keeps them idle
//! for its next requests, and a principal may hold its share of the sessions: without a
//! bound across them, one principal's sessions could hold executors enough to take the
//! host's memory, processes or the daemon's descriptors from every other principal. Each
//! principal gets an equal share of `max_executors`, as of the sessions; an executor holds
//! its place until it is stopped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::ident::PrincipalId;

/// The executors held, by principal.
#[derive(Debug, Default)]
pub struct ExecutorBudget {
    held: Mutex<HashMap<PrincipalId, usize>>,
}

/// Most executors the sessions of one principal hold at once when `principals` are
/// configured: an equal share of `max_executors`, and at least one.
pub fn executor_share(max_executors: usize, principals: usize) -> usize {
    (max_executors / principals.max(1)).max(1)
}

/// One executor's place in its principal's share; given back when dropped.
#[derive(Debug)]
pub struct ExecutorPlace {
    budget: Arc<ExecutorBudget>,
    principal: PrincipalId,
}

impl ExecutorBudget {
    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<PrincipalId, usize>> {
        // Counters only: a panic elsewhere leaves them usable.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for one more executor of `principal`, or `None` when it holds `share`.
    pub fn take(self: &Arc<Self>, principal: &PrincipalId, share: usize) -> Option<ExecutorPlace> {
        let mut held = self.held();
        let n = held.entry(principal.clone()).or_default();
        if *n >= share {
            return None;
        }
        *n += 1;
        Some(ExecutorPlace {
            budget: self.clone(),
            principal: principal.clone(),
        })
    }

    /// How many executors `principal` holds.
    #[cfg(test)]
    pub fn held_by(&self, principal: &PrincipalId) -> usize {
        self.held().get(principal).copied().unwrap_or(0)
    }
}

impl Drop for ExecutorPlace {
    fn drop(&mut self) {
        let mut held = self.budget.held();
        if let Some(n) = held.get_mut(&self.principal) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.principal);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// A principal holds at most its share; a place given back is taken again; another
    /// principal's share is its own.
    #[test]
    fn a_principal_holds_its_share_and_no_more() {
        let budget = std::sync::Arc::new(super::ExecutorBudget::default());
        let (a, b) = (
            crate::ident::PrincipalId::new("a").unwrap(),
            crate::ident::PrincipalId::new("b").unwrap(),
        );
        let share = super::executor_share(4, 2);
        assert_eq!(share, 2);
        let first = budget.take(&a, share).unwrap();
        let _second = budget.take(&a, share).unwrap();
        assert!(budget.take(&a, share).is_none());
        assert!(budget.take(&b, share).is_some());
        drop(first);
        assert_eq!(budget.held_by(&a), 1);
        assert!(budget.take(&a, share).is_some());
        assert_eq!(super::executor_share(4, 9), 1);
    }
}
