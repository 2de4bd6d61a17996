//! Tenant and prefix-key strings from a trace, interned to the table's numeric ids.
//!
//! Memory stays flat over long traces: a tenant is forgotten when no admitted request and no
//! published prefix is its own, a key when its prefix is evicted.

use crate::ids::{PrefixKey, RequestId, TenantId};
use std::collections::HashMap;
use std::sync::Arc;

/// Tenant names, counted by the live requests and prefixes that are theirs.
#[derive(Default, Debug)]
pub(crate) struct Tenants {
    ids: HashMap<Arc<str>, TenantId>,
    names: HashMap<TenantId, (Arc<str>, u64)>,
    next: u64,
}

impl Tenants {
    /// The id of `name`, new (with no references) if unknown.
    pub fn intern(&mut self, name: &str) -> TenantId {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = TenantId(self.next);
        self.next += 1;
        let name: Arc<str> = Arc::from(name);
        self.ids.insert(Arc::clone(&name), id);
        self.names.insert(id, (name, 0));
        id
    }

    /// One more request or prefix of `id`.
    pub fn retain(&mut self, id: TenantId) {
        if let Some(entry) = self.names.get_mut(&id) {
            entry.1 += 1;
        }
    }

    /// One request or prefix of `id` fewer; forgets it at none.
    pub fn release(&mut self, id: TenantId) {
        if let Some(entry) = self.names.get_mut(&id) {
            entry.1 = entry.1.saturating_sub(1);
        }
        self.forget_if_unused(id);
    }

    /// Forgets `id` if nothing refers to it (after a refused admission).
    pub fn forget_if_unused(&mut self, id: TenantId) {
        if let Some((name, 0)) = self.names.get(&id) {
            let name = Arc::clone(name);
            self.names.remove(&id);
            self.ids.remove(&name);
        }
    }

    pub fn name(&self, id: TenantId) -> Option<&Arc<str>> {
        self.names.get(&id).map(|(n, _)| n)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }
}

/// A published prefix: its numeric key and its tenant.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeyEntry {
    pub id: PrefixKey,
    pub tenant: TenantId,
}

/// Published prefix keys.
#[derive(Default, Debug)]
pub(crate) struct Keys {
    ids: HashMap<Arc<str>, KeyEntry>,
    names: HashMap<PrefixKey, Arc<str>>,
    next: u64,
}

impl Keys {
    /// The key no published prefix has: what an unknown key is looked up as.
    pub const UNPUBLISHED: PrefixKey = PrefixKey(u64::MAX);

    pub fn get(&self, name: &str) -> Option<KeyEntry> {
        self.ids.get(name).copied()
    }

    /// The id the next published key will get.
    pub fn next_id(&self) -> PrefixKey {
        PrefixKey(self.next.min(u64::MAX - 1))
    }

    pub fn insert(&mut self, name: &str, entry: KeyEntry) {
        self.next = self.next.saturating_add(1);
        let name: Arc<str> = Arc::from(name);
        self.names.insert(entry.id, Arc::clone(&name));
        self.ids.insert(name, entry);
    }

    pub fn remove(&mut self, name: &str) -> Option<KeyEntry> {
        let entry = self.ids.remove(name)?;
        self.names.remove(&entry.id);
        Some(entry)
    }

    pub fn name(&self, id: PrefixKey) -> Option<&Arc<str>> {
        self.names.get(&id)
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }
}

/// The admitted requests and their tenants, to release tenant names when requests end.
#[derive(Default, Debug)]
pub(crate) struct Live {
    requests: HashMap<RequestId, TenantId>,
}

impl Live {
    pub fn insert(&mut self, req: RequestId, tenant: TenantId) {
        self.requests.insert(req, tenant);
    }
    pub fn remove(&mut self, req: RequestId) -> Option<TenantId> {
        self.requests.remove(&req)
    }
    pub fn tenant(&self, req: RequestId) -> Option<TenantId> {
        self.requests.get(&req).copied()
    }
    pub fn len(&self) -> usize {
        self.requests.len()
    }
}
