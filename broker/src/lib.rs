//! flowhost-broker: placeholder until the broker issue lands.
