//! Rules 9 and 10 (module docs of the registry) and routing: which server serves a resource
//! read, a prompt or a completion, and the label of what it returns.

use super::{AdmissionError, VerifiedRegistry};
use crate::label::InformationLabel;
use crate::manifest::{ContentFlow, ManifestBody, ManifestDigest, PromptDefinition, UnroutableUri};

/// Where a resource read, prompt or completion goes, and the least label of what comes back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContentRoute {
    /// The server that declared the resource or prompt.
    pub server_id: String,
    /// The resource's or prompt's signed name (what principals' patterns name).
    pub name: String,
    /// What the server signed: the resource's URI or template, or the prompt's name (what
    /// records name, rather than a client's text).
    pub declared: String,
    /// `content floor ⊔ signed output label`: never `Top`.
    pub label: InformationLabel,
    /// The digest of the manifest that declared it.
    pub digest: ManifestDigest,
}

/// `floor ⊔ flow.output_label`, or why it is no usable label.
fn entry_label(
    floor: &InformationLabel,
    flow: Option<&ContentFlow>,
) -> Result<InformationLabel, Option<crate::label::LabelError>> {
    let label = match flow {
        Some(f) => floor.join_restrictions(&f.output_label).map_err(Some)?,
        None => floor.clone(),
    };
    if label.is_top() { Err(None) } else { Ok(label) }
}

impl VerifiedRegistry {
    /// Rules 9 and 10 for `body`; the content floor to keep.
    pub(super) fn admit_content(
        &self,
        body: &ManifestBody,
        floor: Option<&InformationLabel>,
    ) -> Result<Option<InformationLabel>, AdmissionError> {
        let server_id = body.server_id();
        if body.resources().is_empty() && body.prompts().is_empty() {
            // Nothing it returns needs a floor.
            return Ok(None);
        }
        let floor = floor.ok_or_else(|| AdmissionError::MissingContentFloor {
            server_id: server_id.to_owned(),
        })?;
        let bad = |entry: String, reason| AdmissionError::ContentLabel {
            server_id: server_id.to_owned(),
            entry,
            reason,
        };
        if floor.is_top() {
            return Err(bad("content_floor".into(), None));
        }
        for r in body.resources() {
            entry_label(floor, r.flow())
                .map_err(|e| bad(format!("resource {}", r.locator().as_str()), e))?;
        }
        for p in body.prompts() {
            entry_label(floor, p.flow()).map_err(|e| bad(format!("prompt {}", p.name()), e))?;
        }
        for r in body.resources() {
            for other in self.servers.values() {
                if let Some(o) = other
                    .envelope
                    .body()
                    .resources()
                    .iter()
                    .find(|o| o.locator().may_overlap(r.locator()))
                {
                    return Err(AdmissionError::AmbiguousResource {
                        server_id: server_id.to_owned(),
                        uri: r.locator().as_str().to_owned(),
                        other_server: other.server_id().to_owned(),
                        other_uri: o.locator().as_str().to_owned(),
                    });
                }
            }
        }
        Ok(Some(floor.clone()))
    }

    fn route(
        &self,
        server_id: &str,
        name: &str,
        declared: &str,
        flow: Option<&ContentFlow>,
    ) -> Option<ContentRoute> {
        let server = self.servers.get(server_id)?;
        // Rule 9 admitted every entry with a floor and a usable label; `None` is fail closed.
        let label = entry_label(server.content_floor.as_ref()?, flow).ok()?;
        Some(ContentRoute {
            server_id: server_id.to_owned(),
            name: name.to_owned(),
            declared: declared.to_owned(),
            label,
            digest: server.digest,
        })
    }

    /// The server whose signed resource `uri` is (an exact URI before a template); refused
    /// when no server's is, when `uri` is not spelt as URIs are routed, and when two
    /// templates of the server that has it match it (admission keeps servers' resources
    /// apart).
    pub fn resource_route(&self, uri: &str) -> Result<ContentRoute, UnroutableUri> {
        for s in self.servers.values() {
            let r = match s.envelope.body().resource_for(uri) {
                Ok(r) => r,
                Err(UnroutableUri::NotSigned { .. }) => continue,
                Err(refused) => return Err(refused),
            };
            if let Some(route) = self.route(s.server_id(), r.name(), r.locator().as_str(), r.flow())
            {
                return Ok(route);
            }
        }
        Err(UnroutableUri::NotSigned {
            uri: uri.to_owned(),
        })
    }

    /// The server whose signed resource has exactly this URI or template text (what a
    /// completion's `ref/resource` names), if any.
    pub fn resource_ref_route(&self, uri_or_template: &str) -> Option<ContentRoute> {
        self.servers.values().find_map(|s| {
            let r = s
                .envelope
                .body()
                .resources()
                .iter()
                .find(|r| r.locator().as_str() == uri_or_template)?;
            self.route(s.server_id(), r.name(), r.locator().as_str(), r.flow())
        })
    }

    /// Prompt `name` of server `server_id`, if signed.
    pub fn prompt_route(&self, server_id: &str, name: &str) -> Option<ContentRoute> {
        let p = self.prompt(server_id, name)?;
        self.route(server_id, p.name(), p.name(), p.flow())
    }

    /// The signed definition of prompt `name` of server `server_id`.
    pub fn prompt(&self, server_id: &str, name: &str) -> Option<&PromptDefinition> {
        self.servers.get(server_id)?.envelope.body().prompt(name)
    }

    /// Every signed resource (templates included), with its server, by server id.
    pub fn resources(&self) -> impl Iterator<Item = (&str, &crate::manifest::ResourceDefinition)> {
        self.servers.values().flat_map(|s| {
            s.envelope
                .body()
                .resources()
                .iter()
                .map(move |r| (s.server_id(), r))
        })
    }

    /// Every signed prompt, with its server, by server id.
    pub fn prompts(&self) -> impl Iterator<Item = (&str, &PromptDefinition)> {
        self.servers.values().flat_map(|s| {
            s.envelope
                .body()
                .prompts()
                .iter()
                .map(move |p| (s.server_id(), p))
        })
    }
}
