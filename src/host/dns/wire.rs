//! DNS messages as the mediator reads and writes them, with the `hickory-proto` codec: the
//! one question of a query, refusals built from the query itself, and the addresses an
//! upstream answer hands out.

use std::net::IpAddr;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{RData, RecordType};

use crate::destination::HostName;

/// A query the mediator can decide: standard, one question, for a valid host name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    /// The query id.
    pub id: u16,
    /// The name asked for.
    pub name: HostName,
    /// The record type asked for (`A`, `AAAA`, ...).
    pub record_type: String,
}

/// Why a message is not a query the mediator decides.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not a DNS message at all (nothing can be answered: no id to answer with).
    #[error("not a DNS message")]
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
    if msg.metadata.message_type != MessageType::Query || msg.metadata.op_code != OpCode::Query {
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
    let name = q.name().to_ascii();
    let name = name
        .parse::<HostName>()
        .map_err(|e| unserved(ResponseCode::Refused, format!("{name:?}: {e}")))?;
    Ok(Question {
        id: msg.metadata.id,
        name,
        record_type: q.query_type().to_string(),
    })
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

/// The addresses an upstream `response` to query `id` hands out (every A and AAAA record of
/// its answer section, CNAME targets included). Anything else is refused: a response that
/// does not decode, answers another id, or is no response.
pub fn handed_out(response: &[u8], id: u16) -> Result<Vec<IpAddr>, String> {
    let msg =
        Message::from_vec(response).map_err(|e| format!("undecodable upstream answer: {e}"))?;
    if msg.metadata.id != id || msg.metadata.message_type != MessageType::Response {
        return Err("the upstream answer is not a response to the query".into());
    }
    Ok(msg
        .answers
        .iter()
        .filter_map(|r| match (&r.data, r.record_type()) {
            (RData::A(a), RecordType::A) => Some(IpAddr::V4(a.0)),
            (RData::AAAA(a), RecordType::AAAA) => Some(IpAddr::V6(a.0)),
            _ => None,
        })
        .collect())
}

/// Whether a UDP `response` was truncated (the question is asked again over TCP).
pub fn truncated(response: &[u8]) -> bool {
    // The TC bit: byte 2, 0x02 (RFC 1035 4.1.1).
    response.len() > 2 && response[2] & 0x02 != 0
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::rdata::A;
    use hickory_proto::rr::{Name, Record};
    use std::str::FromStr;

    /// A standard query for `name` (`A`), as a resolver library sends it.
    pub fn query(id: u16, name: &str) -> Vec<u8> {
        let mut m = Message::query();
        m.metadata.id = id;
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_str(name).unwrap(), RecordType::A));
        m.to_vec().unwrap()
    }

    #[test]
    fn reads_one_question_and_refuses_with_it() {
        let q = question(&query(7, "Fetch.Test.")).unwrap();
        assert_eq!(q.id, 7);
        assert_eq!(q.name.as_str(), "fetch.test");
        assert_eq!(q.record_type, "A");
        let r = Message::from_vec(&refusal(&query(7, "x.test."), ResponseCode::NXDomain)).unwrap();
        assert_eq!(r.metadata.id, 7);
        assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(r.metadata.message_type, MessageType::Response);
        assert_eq!(r.queries.len(), 1);
        assert!(matches!(question(b"\x01"), Err(WireError::Undecodable)));
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

    #[test]
    fn collects_handed_out_addresses() {
        let mut m = Message::from_vec(&query(3, "a.test."))
            .unwrap()
            .into_response();
        m.add_answer(Record::from_rdata(
            Name::from_str("a.test.").unwrap(),
            60,
            RData::A(A::new(192, 0, 2, 7)),
        ));
        let bytes = m.to_vec().unwrap();
        assert_eq!(
            handed_out(&bytes, 3).unwrap(),
            vec!["192.0.2.7".parse::<IpAddr>().unwrap()]
        );
        assert!(handed_out(&bytes, 4).is_err(), "another id");
        assert!(
            handed_out(&query(3, "a.test."), 3).is_err(),
            "not a response"
        );
        assert!(!truncated(&bytes));
    }
}
