//! What the claim plan reads, answered from the caches, the guests and our own recent writes;
//! and from it, which claims are queued for provision (the intent log records them ahead).

use std::sync::Arc;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;

use super::claim_fingerprint;
use crate::controller::decide::{self, Serving, Unmarked};
use crate::controller::handle::Handle;
use crate::controller::node::{ClaimOwner, Pin};
use crate::controller::plan::{self, ClaimFacts, ClaimPlan, DeletedOwner};
use crate::wasm::{Guest, Plugins};

/// The provisioner whose guest this path will call for a cached claim when its turn comes: what
/// [`plan::plan_claim`] decides for it now, unless it was given up or backs off after a failure
/// (recorded when its turn comes, not ahead).
pub(super) fn queued_for_provision(
    handle: &Handle<'_>,
    plugins: &Plugins,
    pvc: &PersistentVolumeClaim,
) -> Option<String> {
    let ctx = handle.ctx();
    let facts = Facts::of(handle, pvc, plugins);
    let ClaimPlan::Provision { provisioner, .. } = plan::plan_claim(pvc, &facts) else {
        return None;
    };
    let uid = pvc.metadata.uid.as_deref()?;
    if ctx.claim_book.is_given_up(uid, claim_fingerprint(pvc, ctx))
        || ctx.claim_book.is_retrying(uid)
    {
        return None;
    }
    Some(provisioner.to_owned())
}

/// What the plan reads, answered from the caches, the guests and our own recent writes.
pub(super) struct Facts<'a> {
    handle: &'a Handle<'a>,
    pvc: &'a PersistentVolumeClaim,
    plugins: &'a Plugins,
    /// The claim's class as cached now.
    pub(super) class: Option<Arc<StorageClass>>,
}

impl<'a> Facts<'a> {
    /// The facts about `pvc`, its class looked up in the cache once.
    pub(super) fn of(
        handle: &'a Handle<'a>,
        pvc: &'a PersistentVolumeClaim,
        plugins: &'a Plugins,
    ) -> Self {
        let class = decide::claim_class(pvc).and_then(|name| handle.ctx().class(name));
        Facts {
            handle,
            pvc,
            plugins,
            class,
        }
    }
}

impl ClaimFacts for Facts<'_> {
    type Guest = Arc<Guest>;

    fn serving(&self, provisioner: &str) -> Serving {
        super::serving(self.plugins, provisioner)
    }

    fn guest(&self, provisioner: &str) -> Option<Arc<Guest>> {
        self.plugins.for_provisioner(provisioner).cloned()
    }

    fn class(&self, name: &str) -> Option<&StorageClass> {
        self.class
            .as_deref()
            .filter(|c| c.metadata.name.as_deref() == Some(name))
    }

    fn holds_finalizer(&self) -> bool {
        self.handle.holds_claim_finalizer(self.pvc)
    }

    fn volumes_listed(&self) -> bool {
        self.handle.ctx().volumes_listed()
    }

    fn pv_known(&self) -> bool {
        decide::pv_name(self.pvc).is_some_and(|pv| self.handle.pv_known(&pv))
    }

    fn owner(&self, class: &StorageClass) -> Option<ClaimOwner> {
        let node = self.handle.ctx().node.as_ref()?;
        Some(node.claim_owner(self.pvc, class))
    }

    fn deleted_owner(&self) -> DeletedOwner {
        let Some(node) = &self.handle.ctx().node else {
            return DeletedOwner::Me;
        };
        match decide::selected_node(self.pvc) {
            Some(me) if me == node.settings.name => DeletedOwner::Me,
            Some(other) if !node.exists(Pin::Name(other)) => DeletedOwner::NodeGone(other.into()),
            _ => DeletedOwner::Other,
        }
    }

    fn unmarked(&self, class: &StorageClass) -> Unmarked {
        let ctx = self.handle.ctx();
        if ctx.settings.wait_for_mark {
            return Unmarked::Wait;
        }
        Unmarked::Ahead {
            bindable_pv_in_class: ctx
                .bindable
                .in_class(class.metadata.name.as_deref().unwrap_or_default()),
        }
    }

    fn guest_busy(&self, provisioner: &str) -> bool {
        self.plugins
            .for_provisioner(provisioner)
            .is_some_and(|g| g.at_capacity())
    }
}
