"""A DNS server on loopback (UDP) that answers A records from a table a test changes.

Kubernetes publishes a headless Service as one A record per ready pod; `DnsServer` stands
in for the cluster's DNS so the gateway's discovery asks a real server over the wire
(dnspython's resolver, pointed at this port) and the test decides which replicas exist:

    with DnsServer() as dns:
        dns.records["inference.lorastack.svc.cluster.local"] = ["127.0.0.2", "127.0.0.3"]
        ... gateway with backends_dns_nameserver=dns.address ...

A name missing from `records`, or mapped to no address, is NXDOMAIN (a headless Service
with no ready pod); `servfail` answers every query SERVFAIL (a DNS outage). `queries`
counts the A questions answered, so a test can wait for the next round of lookups.
"""

from __future__ import annotations

import socket
import threading
from typing import Self

import dns.exception
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

TTL_S = 5  # seconds; what CoreDNS gives a headless Service's records by default


class DnsServer:
    """A DNS server on a loopback UDP port answering A records from `records`, in a thread;
    `servfail` makes it fail every query."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}  # name (no trailing dot) -> IPv4 addresses
        self.servfail = False
        self.queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.05)  # how soon the thread sees `close`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dns-server", daemon=True)

    @property
    def address(self) -> str:
        """IP:PORT of the server (the gateway's `backends_dns_nameserver`)."""
        host, port = self._sock.getsockname()
        return f"{host}:{port}"

    def answer(self, wire: bytes) -> bytes:
        """The response to one query in wire form: the name's A records, NXDOMAIN for an unknown
        name, an empty answer for another type, or SERVFAIL when `servfail` is set."""
        query = dns.message.from_wire(wire)
        response = dns.message.make_response(query)
        if self.servfail:
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire()
        for question in query.question:
            name = question.name.to_text().rstrip(".").lower()
            addresses = list(self.records.get(name, ()))  # a copy: the test may replace it
            if not addresses:
                response.set_rcode(dns.rcode.NXDOMAIN)
            elif question.rdtype == dns.rdatatype.A:
                self.queries += 1
                rrset = dns.rrset.from_text_list(
                    question.name, TTL_S, dns.rdataclass.IN, dns.rdatatype.A, addresses
                )
                response.answer.append(rrset)
            # any other type of a known name: NOERROR with no answer (no AAAA here)
        return response.to_wire()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                wire, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                self._sock.sendto(self.answer(wire), peer)
            except (OSError, dns.exception.DNSException):
                continue  # a malformed query gets no answer, as from a real server

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
