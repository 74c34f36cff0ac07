//! DNS messages as the mediator reads and writes them, with the `hickory-proto` codec: the
//! one question of a query, the query asked upstream in its place, refusals built from the
//! query itself, and the answer passed back with the addresses it hands out.
//!
//! Nothing the executor wrote reaches the upstream resolver but its one question: the
//! upstream query is built anew from the judged name and type (its own random id, the name
//! in lower case, recursion asked, a fixed EDNS payload size, no extra records or options),
//! so a query carries no more out of the host than the name that was judged.

use std::collections::HashSet;
use std::net::IpAddr;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, Name, RData, RecordType};

use crate::destination::HostName;

/// Most CNAME links followed from the name asked to the addresses handed out.
const MAX_CHAIN: usize = 16;
/// The EDNS payload size asked for upstream at most (the size DNS flag day 2020 settled
/// on: no fragmented UDP answers).
const MAX_UDP_PAYLOAD: u16 = 1232;

/// The record type a query asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryType(RecordType);

impl QueryType {
    /// Whether the mediator serves it: A, AAAA, CNAME, HTTPS and SVCB, what a connection
    /// needs. Any other is answered REFUSED and never asked upstream (its 16 bits would be
    /// the executor's to choose, and would leave the host).
    pub fn served(self) -> bool {
        matches!(
            self.0,
            RecordType::A
                | RecordType::AAAA
                | RecordType::CNAME
                | RecordType::HTTPS
                | RecordType::SVCB
        )
    }
}

impl std::fmt::Display for QueryType {
    /// Its mnemonic (`A`, `TXT`), or `TYPE<n>` (RFC 3597) for a type without one.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            RecordType::Unknown(n) => write!(f, "TYPE{n}"),
            known => write!(f, "{known}"),
        }
    }
}

/// A query the mediator can decide: standard, one question of class IN, for a valid host
/// name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    /// The query id.
    pub id: u16,
    /// The name asked for.
    pub name: HostName,
    /// The record type asked for.
    pub record_type: QueryType,
    /// The question as the executor wrote it (the answer repeats it).
    query: Query,
    /// Whether the executor asked for recursion.
    recursion_desired: bool,
    /// The UDP payload size the executor advertised with EDNS, if it sent EDNS.
    edns_payload: Option<u16>,
}

/// Why a message is not a query the mediator decides.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not a DNS query at all (nothing is answered: a message that is no DNS message has no
    /// id to answer with, and a response is not answered).
    #[error("not a DNS query")]
    Undecodable,
    /// A DNS message the mediator does not serve: answered with `answer` (NOTIMP, FORMERR
    /// or REFUSED, built from the message itself).
    #[error("{why}")]
    Unserved {
        /// The refusal to answer with.
        answer: Vec<u8>,
        /// Why.
        why: String,
    },
}

/// Reads the one question of a standard query.
pub fn question(bytes: &[u8]) -> Result<Question, WireError> {
    let msg = Message::from_vec(bytes).map_err(|_| WireError::Undecodable)?;
    let unserved = |code: ResponseCode, why: String| WireError::Unserved {
        answer: refusal_of(&msg, code),
        why,
    };
    // A response is no query to answer (answering it would make two resolvers talk to each
    // other), nor one to record: dropped as a message that is no query at all.
    if msg.metadata.message_type == MessageType::Response {
        return Err(WireError::Undecodable);
    }
    if msg.metadata.op_code != OpCode::Query {
        return Err(unserved(
            ResponseCode::NotImp,
            "only standard queries are answered".into(),
        ));
    }
    let [q] = msg.queries.as_slice() else {
        return Err(unserved(
            ResponseCode::FormErr,
            format!("{} questions in one query", msg.queries.len()),
        ));
    };
    if q.query_class() != DNSClass::IN {
        return Err(unserved(
            ResponseCode::Refused,
            format!("class {} (only IN is answered)", q.query_class()),
        ));
    }
    let name = q.name().to_ascii();
    let name = name
        .parse::<HostName>()
        .map_err(|e| unserved(ResponseCode::Refused, format!("{name:?}: {e}")))?;
    Ok(Question {
        id: msg.metadata.id,
        name,
        record_type: QueryType(q.query_type()),
        query: q.clone(),
        recursion_desired: msg.metadata.recursion_desired,
        edns_payload: msg.edns.as_ref().map(|e| e.max_payload()),
    })
}

/// The query asked upstream for `q`, with id `id`: the judged name (in lower case: the
/// case of each letter as the executor wrote it would be bits of its choosing), the record
/// type, recursion asked for, and EDNS with a fixed payload size (no options), whether or not
/// the executor sent EDNS (else whether it did would be one bit of its choosing per query).
/// Nothing else of the executor's message goes out.
pub fn upstream_query(q: &Question, id: u16) -> Result<Vec<u8>, String> {
    let name = Name::from_ascii(format!("{}.", q.name.as_str()))
        .map_err(|e| format!("cannot encode the name {}: {e}", q.name))?;
    let mut query = Query::query(name, q.query.query_type());
    query.set_query_class(DNSClass::IN);
    let mut m = Message::query();
    m.metadata.id = id;
    m.metadata.recursion_desired = true;
    m.add_query(query);
    let mut edns = Edns::new();
    edns.set_max_payload(MAX_UDP_PAYLOAD);
    m.set_edns(edns);
    m.to_vec()
        .map_err(|e| format!("cannot encode the upstream query: {e}"))
}

/// The most bytes an answer to `q` may have over UDP: the payload size the executor
/// advertised with EDNS, else 512 (RFC 1035).
pub fn udp_limit(q: &Question) -> usize {
    usize::from(q.edns_payload.unwrap_or(512).max(512))
}

/// An empty answer to `q` with the TC bit set: the executor's resolver asks again over TCP
/// (for an answer larger than it said it accepts over UDP).
pub fn truncated_answer(q: &Question) -> Vec<u8> {
    let mut m = Message::response(q.id, OpCode::Query);
    m.metadata.recursion_desired = q.recursion_desired;
    m.metadata.recursion_available = true;
    m.metadata.truncation = true;
    m.add_query(q.query.clone());
    m.to_vec().unwrap_or_default()
}

/// An upstream answer as it is passed back to the executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The answer to send the executor: its own id and question.
    pub bytes: Vec<u8>,
    /// The addresses handed out for the name asked: the A and AAAA records of the answer
    /// section owned by that name or by a name its CNAME chain leads to, if the response
    /// code is NOERROR (none otherwise).
    pub addresses: Vec<AnswerAddress>,
    /// The names the CNAME chain leads through from the name asked (not that name), in
    /// order. The chain is followed only through host names: past a target that is none,
    /// nothing is handed out (no rule could have judged it).
    pub chain: Vec<HostName>,
}

/// One address an answer hands out for the name asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnswerAddress {
    /// The address.
    pub ip: IpAddr,
    /// How long the answer vouches for it, in seconds: the least TTL of its record and of
    /// the CNAME links leading to it.
    pub ttl: u32,
}

/// Reads the upstream `response` to [`upstream_query`]`(q, id)`. Refused: a response that
/// does not decode, is no response, answers another id, or another question (an answer
/// forged or misdirected would otherwise be remembered as the name's address). Only a
/// NOERROR response hands out addresses.
pub fn answer(q: &Question, response: &[u8], id: u16) -> Result<Answer, String> {
    let mut msg = response_to(q, response, id)?;
    let asked = &q.query;
    // Only a NOERROR answer vouches for addresses: whatever records an NXDOMAIN or SERVFAIL
    // carries are passed on, never remembered.
    let (addresses, chain) = if msg.metadata.response_code == ResponseCode::NoError {
        chain_addresses(&msg, asked.name())
    } else {
        (Vec::new(), Vec::new())
    };
    msg.metadata.id = q.id;
    msg.queries = vec![asked.clone()];
    if q.edns_payload.is_none() {
        msg.edns = None;
    }
    let bytes = msg
        .to_vec()
        .map_err(|e| format!("cannot encode the answer: {e}"))?;
    Ok(Answer {
        bytes,
        addresses,
        chain,
    })
}

/// Whether `response` is a response to [`upstream_query`]`(q, id)`: decodable, a response,
/// with that id and that one question, or an error (FORMERR, REFUSED, ...) with that id and
/// no question at all, as some servers send one ([`answer`] then refuses it, and the lookup
/// fails at once rather than at the server's timeout). Anything else that reaches the
/// query's socket is not its answer, and the real one may still come.
pub fn answers(q: &Question, response: &[u8], id: u16) -> bool {
    match response_to(q, response, id) {
        Ok(_) => true,
        Err(_) => Message::from_vec(response).is_ok_and(|m| {
            m.metadata.id == id
                && m.metadata.message_type == MessageType::Response
                && m.metadata.response_code != ResponseCode::NoError
                && m.queries.is_empty()
        }),
    }
}

fn response_to(q: &Question, response: &[u8], id: u16) -> Result<Message, String> {
    let msg =
        Message::from_vec(response).map_err(|e| format!("undecodable upstream answer: {e}"))?;
    if msg.metadata.id != id || msg.metadata.message_type != MessageType::Response {
        return Err("the upstream answer is not a response to the query".into());
    }
    let asked = &q.query;
    match msg.queries.as_slice() {
        [a] if same_name(a.name(), asked.name())
            && a.query_type() == asked.query_type()
            && a.query_class() == DNSClass::IN =>
        {
            Ok(msg)
        }
        _ => Err("the upstream answer is for another question".into()),
    }
}

fn same_name(a: &Name, b: &Name) -> bool {
    key(a) == key(b)
}

/// A name as compared here: lower case, without the root's dot.
fn key(n: &Name) -> String {
    n.to_ascii().trim_end_matches('.').to_ascii_lowercase()
}

/// The addresses of `msg`'s answer section that belong to `name` or a name its CNAME chain
/// (at most [`MAX_CHAIN`] links, through host names only) leads to, and the names of that
/// chain after `name`: an answer may carry records for other names, which are not what the
/// executor asked for.
fn chain_addresses(msg: &Message, name: &Name) -> (Vec<AnswerAddress>, Vec<HostName>) {
    let mut seen = HashSet::from([key(name)]);
    // Each name of the chain after `name`, with the least TTL of the links leading to it.
    let mut chain: Vec<(HostName, u32)> = Vec::new();
    let (mut at, mut ttl) = (key(name), u32::MAX);
    for _ in 0..MAX_CHAIN {
        let next = msg.answers.iter().find_map(|r| match &r.data {
            RData::CNAME(target) if key(&r.name) == at => Some((key(&target.0), r.ttl)),
            _ => None,
        });
        let Some((target, link)) = next.filter(|(t, _)| seen.insert(t.clone())) else {
            break;
        };
        let Ok(host) = target.parse::<HostName>() else {
            break;
        };
        ttl = ttl.min(link);
        chain.push((host, ttl));
        at = target;
    }
    // The least TTL of the links leading to `owner`, if it is on the chain.
    let reach = |owner: &Name| {
        let owner = key(owner);
        if owner == key(name) {
            return Some(u32::MAX);
        }
        chain
            .iter()
            .find(|(c, _)| c.as_str() == owner)
            .map(|(_, ttl)| *ttl)
    };
    let addresses = msg
        .answers
        .iter()
        .filter_map(|r| {
            let ip = match (&r.data, r.record_type()) {
                (RData::A(a), RecordType::A) => IpAddr::V4(a.0),
                (RData::AAAA(a), RecordType::AAAA) => IpAddr::V6(a.0),
                _ => return None,
            };
            let ttl = reach(&r.name)?.min(r.ttl);
            Some(AnswerAddress { ip, ttl })
        })
        .collect();
    (addresses, chain.into_iter().map(|(c, _)| c).collect())
}

/// The answer `code` (NXDOMAIN for a name no rule names, REFUSED, ...) to `query`, which
/// [`question`] read.
pub fn refusal(query: &[u8], code: ResponseCode) -> Vec<u8> {
    match Message::from_vec(query) {
        Ok(msg) => refusal_of(&msg, code),
        Err(_) => Vec::new(),
    }
}

fn refusal_of(query: &Message, code: ResponseCode) -> Vec<u8> {
    let mut answer = Message::error_msg(query.metadata.id, query.metadata.op_code, code);
    answer.metadata.recursion_desired = query.metadata.recursion_desired;
    answer.metadata.recursion_available = true;
    answer.add_queries(query.queries.iter().cloned());
    answer.to_vec().unwrap_or_default()
}

/// Whether a UDP `response` was truncated (the question is asked again over TCP).
pub fn truncated(response: &[u8]) -> bool {
    // The TC bit: byte 2, 0x02 (RFC 1035 4.1.1).
    response.len() > 2 && response[2] & 0x02 != 0
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use hickory_proto::rr::Record;
    use hickory_proto::rr::rdata::opt::EdnsOption;
    use hickory_proto::rr::rdata::{A, CNAME};
    use std::str::FromStr;

    /// A standard query for `name` (`A`), as a resolver library sends it.
    pub fn query(id: u16, name: &str) -> Vec<u8> {
        typed_query(id, name, RecordType::A)
    }

    /// A standard query for `name`, of type `rtype`.
    pub fn typed_query(id: u16, name: &str, rtype: RecordType) -> Vec<u8> {
        let mut m = Message::query();
        m.metadata.id = id;
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_str(name).unwrap(), rtype));
        m.to_vec().unwrap()
    }

    #[test]
    fn reads_one_question_and_refuses_with_it() {
        let q = question(&query(7, "Fetch.Test.")).unwrap();
        assert_eq!(q.id, 7);
        assert_eq!(q.name.as_str(), "fetch.test");
        assert_eq!(q.record_type.to_string(), "A");
        assert!(q.record_type.served());
        let r = Message::from_vec(&refusal(&query(7, "x.test."), ResponseCode::NXDomain)).unwrap();
        assert_eq!(r.metadata.id, 7);
        assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(r.metadata.message_type, MessageType::Response);
        assert_eq!(r.queries.len(), 1);
        assert!(matches!(question(b"\x01"), Err(WireError::Undecodable)));
        // A response sent to the resolver is not answered (nor recorded).
        let response = refusal(&query(8, "x.test."), ResponseCode::NXDomain);
        assert!(matches!(question(&response), Err(WireError::Undecodable)));
        let mut two = Message::from_vec(&query(9, "a.test.")).unwrap();
        two.add_query(Query::query(
            Name::from_str("b.test.").unwrap(),
            RecordType::A,
        ));
        assert!(matches!(
            question(&two.to_vec().unwrap()),
            Err(WireError::Unserved { .. })
        ));
    }

    /// The upstream's response to `asked` (bytes of [`upstream_query`]), with `records`.
    fn respond(asked: &[u8], records: Vec<Record>) -> Vec<u8> {
        let mut m = Message::from_vec(asked).unwrap().into_response();
        m.add_answers(records);
        m.to_vec().unwrap()
    }

    /// The addresses `answer` hands out, as text.
    fn ips(answer: &Answer) -> Vec<String> {
        answer.addresses.iter().map(|a| a.ip.to_string()).collect()
    }

    #[test]
    fn an_address_lasts_as_long_as_its_record_and_the_links_to_it() {
        let q = question(&query(3, "a.test.")).unwrap();
        let asked = upstream_query(&q, 1).unwrap();
        let with_ttl = |mut r: Record, ttl: u32| {
            r.ttl = ttl;
            r
        };
        let bytes = respond(
            &asked,
            vec![
                with_ttl(cname("a.test.", "b.test."), 300),
                with_ttl(cname("b.test.", "c.test."), 40),
                with_ttl(a("c.test.", [192, 0, 2, 1]), 900),
                with_ttl(a("b.test.", [192, 0, 2, 2]), 100),
                with_ttl(a("a.test.", [192, 0, 2, 3]), 7),
            ],
        );
        let got: Vec<(String, u32)> = answer(&q, &bytes, 1)
            .unwrap()
            .addresses
            .iter()
            .map(|a| (a.ip.to_string(), a.ttl))
            .collect();
        assert_eq!(
            got,
            [
                ("192.0.2.1".to_string(), 40),
                ("192.0.2.2".to_string(), 100),
                ("192.0.2.3".to_string(), 7)
            ]
        );
    }

    fn a(owner: &str, ip: [u8; 4]) -> Record {
        Record::from_rdata(
            Name::from_str(owner).unwrap(),
            60,
            RData::A(A::new(ip[0], ip[1], ip[2], ip[3])),
        )
    }

    fn cname(owner: &str, target: &str) -> Record {
        Record::from_rdata(
            Name::from_str(owner).unwrap(),
            60,
            RData::CNAME(CNAME(Name::from_str(target).unwrap())),
        )
    }

    #[test]
    fn passes_back_the_answer_with_the_executors_id_and_question() {
        let q = question(&query(3, "A.Test.")).unwrap();
        let asked = upstream_query(&q, 4242).unwrap();
        let bytes = respond(&asked, vec![a("a.test.", [192, 0, 2, 7])]);
        let got = answer(&q, &bytes, 4242).unwrap();
        assert_eq!(ips(&got), ["192.0.2.7"]);
        let m = Message::from_vec(&got.bytes).unwrap();
        assert_eq!(m.metadata.id, 3);
        assert_eq!(m.queries, vec![q.query.clone()]);
        assert!(answer(&q, &bytes, 4243).is_err(), "another id");
        assert!(answer(&q, &asked, 4242).is_err(), "not a response");
        assert!(!truncated(&bytes));
    }

    #[test]
    fn only_a_noerror_answer_hands_out_addresses() {
        let q = question(&query(3, "a.test.")).unwrap();
        let asked = upstream_query(&q, 5).unwrap();
        for code in [
            ResponseCode::NXDomain,
            ResponseCode::ServFail,
            ResponseCode::Refused,
            ResponseCode::NotImp,
            ResponseCode::FormErr,
        ] {
            let mut r = Message::from_vec(&asked).unwrap().into_response();
            r.add_answer(a("a.test.", [192, 0, 2, 7]));
            r.metadata.response_code = code;
            let got = answer(&q, &r.to_vec().unwrap(), 5).unwrap();
            assert!(got.addresses.is_empty(), "{code:?}: {got:?}");
            // The executor still gets the upstream's answer, code and all.
            let back = Message::from_vec(&got.bytes).unwrap();
            assert_eq!(back.metadata.response_code, code);
        }
        let got = answer(&q, &respond(&asked, vec![a("a.test.", [192, 0, 2, 7])]), 5).unwrap();
        assert_eq!(ips(&got), ["192.0.2.7"]);
    }

    #[test]
    fn an_answer_to_another_question_is_refused() {
        let q = question(&query(3, "a.test.")).unwrap();
        let other = question(&query(3, "b.test.")).unwrap();
        let asked = upstream_query(&other, 9).unwrap();
        let bytes = respond(&asked, vec![a("a.test.", [192, 0, 2, 7])]);
        assert!(answer(&q, &bytes, 9).is_err());
    }

    #[test]
    fn the_upstream_query_carries_only_the_question() {
        // An executor's query with a private EDNS option and an extra record: neither, nor
        // its id, leaves the host.
        let mut m = Message::from_vec(&query(77, "a.test.")).unwrap();
        let mut edns = Edns::new();
        edns.set_max_payload(4096);
        edns.options_mut()
            .insert(EdnsOption::Unknown(65001, vec![0x5e; 2000]));
        m.set_edns(edns);
        m.add_additional(a("secret.invalid.", [10, 0, 0, 1]));
        let bytes = m.to_vec().unwrap();
        let q = question(&bytes).unwrap();
        let up = Message::from_vec(&upstream_query(&q, 1234).unwrap()).unwrap();
        assert_eq!(up.metadata.id, 1234);
        assert_eq!(up.queries.len(), 1);
        assert_eq!(up.queries[0].name().to_ascii(), "a.test.");
        assert!(up.answers.is_empty() && up.authorities.is_empty());
        assert!(up.additionals.is_empty());
        let edns = up.edns.expect("the executor sent EDNS");
        assert_eq!(edns.max_payload(), MAX_UDP_PAYLOAD);
        assert!(edns.options().options.is_empty(), "no options pass");
        // Without EDNS from the executor, the same fixed EDNS upstream (whether it sent any
        // is not told), and none in its answer.
        let plain = question(&query(5, "a.test.")).unwrap();
        let asked = upstream_query(&plain, 6).unwrap();
        assert_eq!(
            Message::from_vec(&asked)
                .unwrap()
                .edns
                .map(|e| e.max_payload()),
            Some(MAX_UDP_PAYLOAD)
        );
        let mut r = Message::from_vec(&asked).unwrap().into_response();
        r.set_edns(Edns::new());
        let got = answer(&plain, &r.to_vec().unwrap(), 6).unwrap();
        assert!(Message::from_vec(&got.bytes).unwrap().edns.is_none());
        // A class other than IN is not asked at all.
        let mut chaos = Message::from_vec(&query(8, "version.bind.")).unwrap();
        chaos.queries[0].set_query_class(DNSClass::CH);
        assert!(matches!(
            question(&chaos.to_vec().unwrap()),
            Err(WireError::Unserved { .. })
        ));
    }

    #[test]
    fn the_upstream_query_carries_no_bits_of_the_executors_choosing() {
        // Letter case, recursion and the EDNS payload size are all the executor's to set:
        // none of them reaches the upstream resolver.
        let mut m = Message::from_vec(&query(1, "SeCrEt.A.TeSt.")).unwrap();
        m.metadata.recursion_desired = false;
        let mut edns = Edns::new();
        edns.set_max_payload(777);
        m.set_edns(edns);
        let q = question(&m.to_vec().unwrap()).unwrap();
        let up = Message::from_vec(&upstream_query(&q, 9).unwrap()).unwrap();
        assert_eq!(up.queries[0].name().to_ascii(), "secret.a.test.");
        assert!(up.metadata.recursion_desired);
        assert_eq!(up.edns.map(|e| e.max_payload()), Some(MAX_UDP_PAYLOAD));
        // The answer goes back with the executor's own question; over UDP, one larger than
        // it accepts is replaced by a truncated one.
        let got = answer(&q, &respond(&upstream_query(&q, 9).unwrap(), vec![]), 9).unwrap();
        let back = Message::from_vec(&got.bytes).unwrap();
        assert_eq!(back.queries, vec![q.query.clone()]);
        assert_eq!(udp_limit(&q), 777);
        let tc = Message::from_vec(&truncated_answer(&q)).unwrap();
        assert!(tc.metadata.truncation && tc.answers.is_empty());
        assert_eq!(tc.metadata.id, 1);
        // Whether the executor sent EDNS at all is not told either: before, the upstream
        // query carried an OPT record exactly when the executor's did, one bit per query.
        let plain = question(&query(1, "secret.a.test.")).unwrap();
        assert!(plain.edns_payload.is_none());
        assert_eq!(
            upstream_query(&plain, 9).unwrap(),
            upstream_query(&q, 9).unwrap()
        );
        // The answer to a query without EDNS carries none, and over UDP holds 512 bytes.
        let got = answer(
            &plain,
            &respond(&upstream_query(&plain, 9).unwrap(), vec![]),
            9,
        )
        .unwrap();
        assert!(Message::from_vec(&got.bytes).unwrap().edns.is_none());
        assert_eq!(udp_limit(&plain), 512);
    }

    #[test]
    fn only_addresses_on_the_names_chain_are_handed_out() {
        let q = question(&query(3, "a.test.")).unwrap();
        let asked = upstream_query(&q, 1).unwrap();
        let bytes = respond(
            &asked,
            vec![
                cname("A.test.", "edge.cdn.test."),
                cname("edge.cdn.test.", "node.cdn.test."),
                a("node.cdn.test.", [192, 0, 2, 8]),
                // Not on the chain: an answer may not vouch for another name's address.
                a("bank.test.", [203, 0, 113, 9]),
            ],
        );
        let got = answer(&q, &bytes, 1).unwrap();
        assert_eq!(ips(&got), ["192.0.2.8"]);
        let chain: Vec<&str> = got.chain.iter().map(HostName::as_str).collect();
        assert_eq!(chain, ["edge.cdn.test", "node.cdn.test"]);
        // A target that is no host name ends the chain: nothing past it is handed out.
        let bytes = respond(
            &asked,
            vec![
                cname("a.test.", "odd\\.name.test."),
                a("odd\\.name.test.", [192, 0, 2, 10]),
            ],
        );
        let got = answer(&q, &bytes, 1).unwrap();
        assert!(got.addresses.is_empty() && got.chain.is_empty(), "{got:?}");
        // A loop ends the chain.
        let bytes = respond(
            &asked,
            vec![
                cname("a.test.", "b.test."),
                cname("b.test.", "a.test."),
                a("b.test.", [192, 0, 2, 9]),
            ],
        );
        assert_eq!(ips(&answer(&q, &bytes, 1).unwrap()), ["192.0.2.9"]);
    }
}
