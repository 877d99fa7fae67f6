//! The generated bindings of `wit/provisioner.wit`, generated once here so that guests written
//! on the SDK contain no bindgen code of their own.
//!
//! The lifecycle world and each optional hook are generated separately: wit-component requires
//! a component to export everything its embedded world names, so a guest must embed exactly the
//! hooks it exports. Each generation embeds its world only from its export macro, which
//! [`export_provisioner!`](crate::export_provisioner) calls for the hooks the author lists.

wit_bindgen::generate!({
    path: "../../wit",
    world: "provisioner",
    additional_derives: [PartialEq, Eq],
    pub_export_macro: true,
    export_macro_name: "export_lifecycle",
});

/// One generation per optional hook, sharing the types above.
pub mod hooks {
    /// `qualifier` (`should-provision`).
    pub mod qualifier {
        wit_bindgen::generate!({
            path: "../../wit",
            inline: "package wasm-provisioner:sdk-qualifier;
                     world qualifier-hook { export wasm-provisioner:provisioner/qualifier@0.1.3; }",
            world: "wasm-provisioner:sdk-qualifier/qualifier-hook",
            with: {
                "wasm-provisioner:provisioner/types@0.1.3": crate::bindings::wasm_provisioner::provisioner::types,
            },
            pub_export_macro: true,
            export_macro_name: "export_qualifier",
        });
    }

    /// `deletion-guard` (`should-delete`).
    pub mod deletion_guard {
        wit_bindgen::generate!({
            path: "../../wit",
            inline: "package wasm-provisioner:sdk-deletion-guard;
                     world deletion-guard-hook { export wasm-provisioner:provisioner/deletion-guard@0.1.3; }",
            world: "wasm-provisioner:sdk-deletion-guard/deletion-guard-hook",
            with: {
                "wasm-provisioner:provisioner/types@0.1.3": crate::bindings::wasm_provisioner::provisioner::types,
            },
            pub_export_macro: true,
            export_macro_name: "export_deletion_guard",
        });
    }

    /// `capabilities` (`supported`).
    pub mod capabilities {
        wit_bindgen::generate!({
            path: "../../wit",
            inline: "package wasm-provisioner:sdk-capabilities;
                     world capabilities-hook { export wasm-provisioner:provisioner/capabilities@0.1.3; }",
            world: "wasm-provisioner:sdk-capabilities/capabilities-hook",
            pub_export_macro: true,
            export_macro_name: "export_capabilities",
        });
    }

    /// `cloning` (`provision-clone`).
    pub mod cloning {
        wit_bindgen::generate!({
            path: "../../wit",
            inline: "package wasm-provisioner:sdk-cloning;
                     world cloning-hook {
                         import wasm-provisioner:provisioner/volume-builder@0.1.3;
                         export wasm-provisioner:provisioner/cloning@0.1.3;
                     }",
            world: "wasm-provisioner:sdk-cloning/cloning-hook",
            with: {
                "wasm-provisioner:provisioner/types@0.1.3": crate::bindings::wasm_provisioner::provisioner::types,
                "wasm-provisioner:provisioner/volume-builder@0.1.3": crate::bindings::wasm_provisioner::provisioner::volume_builder,
            },
            pub_export_macro: true,
            export_macro_name: "export_cloning",
        });
    }

    /// `expansion` (`expand`).
    pub mod expansion {
        wit_bindgen::generate!({
            path: "../../wit",
            inline: "package wasm-provisioner:sdk-expansion;
                     world expansion-hook { export wasm-provisioner:provisioner/expansion@0.1.3; }",
            world: "wasm-provisioner:sdk-expansion/expansion-hook",
            with: {
                "wasm-provisioner:provisioner/types@0.1.3": crate::bindings::wasm_provisioner::provisioner::types,
            },
            pub_export_macro: true,
            export_macro_name: "export_expansion",
        });
    }

    /// `block-support` (`supports-block`).
    pub mod block_support {
        wit_bindgen::generate!({
            path: "../../wit",
            inline: "package wasm-provisioner:sdk-block-support;
                     world block-support-hook { export wasm-provisioner:provisioner/block-support@0.1.3; }",
            world: "wasm-provisioner:sdk-block-support/block-support-hook",
            pub_export_macro: true,
            export_macro_name: "export_block_support",
        });
    }
}
